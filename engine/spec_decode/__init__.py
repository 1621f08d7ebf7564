"""Speculative decoding: propose tokens cheaply, verify them all in one model step.

`ngram.py` proposes by prompt lookup; `verify.py` keeps the proposed tokens that sampling
confirms. The scheduler asks for proposals and schedules them beside the request's next token
(engine/core/scheduler.py); the model runner samples every proposed position and returns the
accepted tokens (engine/worker/model_runner.py).
"""

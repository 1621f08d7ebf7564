"""Disaggregated prefill/decode: moving KV blocks between engine instances."""

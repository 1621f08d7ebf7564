"""Stand-in for `vllm.inputs`: a prompt of token ids is a dict, as in vLLM."""


def TokensPrompt(prompt_token_ids: list[int]) -> dict[str, list[int]]:
    return {"prompt_token_ids": prompt_token_ids}

"""The batched sampler: one token per row from the model's logits, plus optional logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tidegate.engine.sampling_params import SamplingParams
from tidegate.engine.worker.penalties import apply_penalties, pad_token_ids


@dataclass
class SamplingMetadata:
    """Sampling inputs for N rows as batched tensors; a None field means no row needs it."""

    all_greedy: bool
    # Per-row temperature, 1.0 on greedy rows; None when every row is greedy.
    temperature: torch.Tensor | None = None
    # True on greedy rows; None unless greedy and random rows are mixed.
    greedy_rows: torch.Tensor | None = None
    top_k: torch.Tensor | None = None  # int64, 0 = off
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    # Row index -> that request's generator (on the logits' device); random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Token histories padded with vocab_size; the prompt only for the repetition penalty.
    prompt_token_ids: torch.Tensor | None = None
    output_token_ids: torch.Tensor | None = None
    repetition_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    # (rows, token ids) whose logits are -inf because the request is below min_tokens.
    min_tokens_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    # OpenAI's logit_bias, flattened over the rows that have one: (rows, token ids, values).
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids: (rows, bool [rows, vocab]); a row samples only its True tokens.
    allowed_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    # Structured outputs: (rows, int32 bitmask [rows, words]); a clear bit forbids a token.
    grammar_bitmask: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None


@dataclass
class SamplerOutput:
    """Sampled tokens on CPU; the logprob fields are set only when some row asked for them."""

    sampled_token_ids: torch.Tensor  # [N] int64
    # Column 0 is the sampled token, then the top K of the raw distribution (K = batch max).
    logprob_token_ids: torch.Tensor | None = None  # [N, K+1] int64
    logprobs: torch.Tensor | None = None  # [N, K+1] float32
    sampled_token_ranks: torch.Tensor | None = None  # [N] int64, 1 = most likely


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    vocab_size: int,
    device: torch.device | str,
) -> SamplingMetadata:
    """Batch the rows' parameters into tensors, leaving out every feature no row uses."""
    assert len(params) == len(prompt_token_ids) == len(output_token_ids)
    greedy = [p.greedy for p in params]

    def per_row(values: list, neutral: float, dtype: torch.dtype) -> torch.Tensor | None:
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=dtype, device=device)

    def random_only(values: list, neutral: float) -> list:
        # Greedy rows ignore truncation, so their values must not switch a feature on.
        return [neutral if g else v for v, g in zip(values, greedy, strict=True)]

    meta = SamplingMetadata(all_greedy=all(greedy))
    if not meta.all_greedy:
        temperatures = random_only([p.temperature for p in params], 1.0)
        meta.temperature = torch.tensor(temperatures, dtype=torch.float32, device=device)
        if any(greedy):
            meta.greedy_rows = torch.tensor(greedy, dtype=torch.bool, device=device)
        # A top_k covering the whole vocab is no truncation at all.
        top_k = [p.top_k if p.top_k < vocab_size else 0 for p in params]
        meta.top_k = per_row(random_only(top_k, 0), 0, torch.int64)
        meta.top_p = per_row(random_only([p.top_p for p in params], 1.0), 1.0, torch.float32)
        meta.min_p = per_row(random_only([p.min_p for p in params], 0.0), 0.0, torch.float32)
        meta.generators = {row: g for row, g in generators.items() if not greedy[row]}

    # Penalties change which token is the argmax, so they apply to greedy rows too.
    f32 = torch.float32
    meta.repetition_penalties = per_row([p.repetition_penalty for p in params], 1.0, f32)
    presence = per_row([p.presence_penalty for p in params], 0.0, f32)
    frequency = per_row([p.frequency_penalty for p in params], 0.0, f32)
    if presence is not None or frequency is not None:
        meta.presence_penalties = presence if presence is not None else torch.zeros_like(frequency)
        meta.frequency_penalties = (
            frequency if frequency is not None else torch.zeros_like(presence)
        )
    if meta.repetition_penalties is not None:
        meta.prompt_token_ids = pad_token_ids(prompt_token_ids, vocab_size, device)
    if meta.repetition_penalties is not None or meta.presence_penalties is not None:
        meta.output_token_ids = pad_token_ids(output_token_ids, vocab_size, device)

    meta.min_tokens_mask = _min_tokens_mask(params, output_token_ids, vocab_size, device)
    meta.logit_bias = _logit_bias(params, device)
    meta.allowed_tokens = _allowed_tokens(params, vocab_size, device)
    requested = [p.logprobs for p in params if p.logprobs is not None]
    meta.max_num_logprobs = max(requested) if requested else None
    return meta


def _min_tokens_mask(
    params: list[SamplingParams],
    output_token_ids: list[list[int]],
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        # A grammar decides when a constrained output may end (it allows only EOS once the
        # output is complete): min_tokens cannot hold it open.
        if len(output) >= p.min_tokens or p.structured_outputs is not None:
            continue
        # The engine leaves EOS out of all_stop_token_ids under ignore_eos, so no check here.
        stops = [t for t in p.all_stop_token_ids | set(p.stop_token_ids) if t < vocab_size]
        rows.extend([row] * len(stops))
        token_ids.extend(stops)
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
    )


def _logit_bias(
    params: list[SamplingParams], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            rows.extend([row] * len(p.logit_bias))
            token_ids.extend(p.logit_bias)
            values.extend(p.logit_bias.values())
    if not rows:
        return None
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(token_ids, dtype=torch.int64, device=device),
        torch.tensor(values, dtype=torch.float32, device=device),
    )


def _allowed_tokens(
    params: list[SamplingParams], vocab_size: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids is not None]
    if not rows:
        return None
    mask_rows = [i for i, row in enumerate(rows) for _ in params[row].allowed_token_ids]
    token_ids = [t for row in rows for t in params[row].allowed_token_ids]
    allowed = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
    index = torch.tensor([mask_rows, token_ids], dtype=torch.int64, device=device)
    allowed[index[0], index[1]] = True
    return torch.tensor(rows, dtype=torch.int64, device=device), allowed


class Sampler:
    """Picks one token per row: logit bias and token masks, penalties, then greedy or truncated
    random sampling."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from float32 logits [N, V]; logprobs describe the raw, unpenalized logits."""
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        masks = (meta.min_tokens_mask, meta.grammar_bitmask, meta.logit_bias, meta.allowed_tokens)
        if any(m is not None for m in masks):
            logits = logits.clone()  # the caller's logits stay untouched
        if meta.logit_bias is not None:
            rows, token_ids, values = meta.logit_bias
            logits.index_put_((rows, token_ids), values, accumulate=True)
        if meta.allowed_tokens is not None:
            rows, allowed = meta.allowed_tokens
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
        if meta.min_tokens_mask is not None:
            logits[meta.min_tokens_mask] = float("-inf")
        if meta.grammar_bitmask is not None:
            apply_token_bitmask(logits, *meta.grammar_bitmask)
        logits = apply_penalties(
            logits,
            meta.prompt_token_ids,
            meta.output_token_ids,
            meta.repetition_penalties,
            meta.presence_penalties,
            meta.frequency_penalties,
        )
        sampled = self._sample(logits, meta)
        output = SamplerOutput(sampled_token_ids=sampled.cpu())
        if raw_logprobs is not None:
            _fill_logprobs(output, raw_logprobs, sampled, meta.max_num_logprobs)
        return output

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.greedy_rows is None and not meta.all_greedy else row_argmax(logits)
        if meta.all_greedy:
            return greedy
        logits = logits / meta.temperature[:, None]
        if meta.top_k is not None:
            logits = apply_top_k(logits, meta.top_k)
        if meta.top_p is not None:
            logits = apply_top_p(logits, meta.top_p)
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        sampled = sample_categorical(probs, meta.generators)
        return sampled if greedy is None else torch.where(meta.greedy_rows, greedy, sampled)


_BIT_POSITIONS: dict[torch.device, torch.Tensor] = {}


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place and in one batched op, every token a row's bitmask forbids.

    Bit j of word i allows token 32*i + j (xgrammar's and llguidance's layout); tokens past
    the bitmask's end are forbidden.
    """
    device = logits.device
    shifts = _BIT_POSITIONS.get(device)
    if shifts is None:
        shifts = _BIT_POSITIONS[device] = torch.arange(32, dtype=torch.int32, device=device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask everything below each row's k-th largest logit (k = 0: keep all), without a sort."""
    max_k = int(top_k.max())
    kth_index = (top_k.clamp(1, max_k) - 1)[:, None]
    kth_value = logits.topk(max_k, dim=-1).values.gather(1, kth_index)
    threshold = torch.where(top_k[:, None] > 0, kth_value, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the tail to drop comes first
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p[:, None]
    drop[:, -1] = False  # the most likely token always survives
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens less likely than min_p times the row's most likely token."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_categorical(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from probs (unnormalized, non-negative), by inverse CDF: the first
    token whose cumulative probability passes a uniform draw times the row's total.

    One random number per row: drawing one per token instead (argmax of probs over
    exponential noise) costs torch's CPU generator 17 ms a step for 32 rows of a 32,000-token
    vocabulary; this takes about 0.4 ms.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    draws = torch.empty_like(total)
    if len(generators) < probs.shape[0]:
        draws.uniform_()
    # A seeded row draws only from its own generator, so its tokens cannot depend on the batch.
    for row, generator in generators.items():
        draws[row].uniform_(generator=generator)
    # A draw is below 1, but times the total it may round up to it: cap at the float below.
    target = torch.minimum(draws * total, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return sampled.clamp_max_(probs.shape[1] - 1)  # a row of NaN finds no token


def _ranked(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token a row (sampled, or a prompt's next): ids and logprobs of the token then the
    top num_top, and the token's rank."""
    chosen = logprobs.gather(1, token_ids[:, None])
    # Rank counts the tokens at least as likely as the given one, itself included.
    ranks = (logprobs >= chosen).sum(dim=-1)
    top_logprobs, top_ids = logprobs.topk(num_top, dim=-1)
    ids = torch.cat([token_ids[:, None], top_ids], dim=1)
    return ids, torch.cat([chosen, top_logprobs], dim=1), ranks


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: int
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """For rows of float32 logits and one given token a row (a prompt's next token): the
    token's logprob, then the top num_top, and its rank, as sampled tokens get them."""
    ids, values, ranks = _ranked(torch.log_softmax(logits, dim=-1), token_ids, num_top)
    return ids.tolist(), values.tolist(), ranks.tolist()


def _fill_logprobs(
    output: SamplerOutput, logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> None:
    ids, values, ranks = _ranked(logprobs, sampled, num_top)
    output.logprob_token_ids = ids.cpu()
    output.logprobs = values.cpu()
    output.sampled_token_ranks = ranks.cpu()


def position_seed(seed: int, position: int) -> int:
    """The seed of a request's draw for its output token `position`: the request's seed and
    the position mixed by SplitMix64, so that nearby seeds and positions draw unrelated
    numbers."""
    mask = (1 << 64) - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) (the first index of each row's maximum, or of a NaN), through max: on
    CPU torch's argmax is about 3x slower over a [32, 32000] fp32 batch (1.1 ms a step)."""
    return x.max(dim=-1).indices

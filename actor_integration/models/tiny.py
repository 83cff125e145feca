"""`TinyLM`: the small causal transformer the demo trains and the reference engine serves.

Neutral ground: the demo's trainer, the reference rollout engine and the benchmarks all build
it; `weights_checksum` says whether two copies of its weights are bit-identical.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["TinyLM", "TinyLMConfig", "weights_checksum"]


@dataclass(frozen=True, kw_only=True)
class TinyLMConfig:
    vocab_size: int = 97
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    max_seq_len: int = 64
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLMConfig.{name} must be a positive int, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"TinyLMConfig: dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"TinyLMConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]


class _Block(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, cache: torch.Tensor, start: int) -> torch.Tensor:
        """x: [T, dim] for positions start..start+T-1; cache: [2, max_tokens, dim], written in place."""
        steps, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(dim, dim=-1)
        # Attend over the cached prefix plus this call's own keys, and write detached copies: reading
        # back the slices just written would make a training step's backward see in-place edits.
        keys, values = torch.cat([cache[0, :start], k]), torch.cat([cache[1, :start], v])
        cache[0, start : start + steps] = k.detach()
        cache[1, start : start + steps] = v.detach()
        end = start + steps
        heads, head_dim = self.n_heads, dim // self.n_heads
        qh = q.view(steps, heads, head_dim).transpose(0, 1)
        kh = keys.view(end, heads, head_dim).transpose(0, 1)
        vh = values.view(end, heads, head_dim).transpose(0, 1)
        scores = qh @ kh.transpose(1, 2) / head_dim**0.5
        positions = torch.arange(start, end, device=x.device)[:, None]
        visible = torch.arange(end, device=x.device)[None, :] <= positions
        scores = scores.masked_fill(~visible, float("-inf"))
        attended = (scores.softmax(dim=-1) @ vh).transpose(0, 1).reshape(steps, dim)
        x = x + self.proj(attended)
        out: torch.Tensor = x + self.down(nn.functional.gelu(self.up(self.norm2(x))))
        return out


class TinyLM(nn.Module):
    """A small causal transformer LM with a KV cache; the demo's trainer trains the same class."""

    def __init__(self, config: TinyLMConfig | None = None) -> None:
        super().__init__()
        self.config = config = config or TinyLMConfig()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(config.seed)
        try:
            self.embed = nn.Embedding(config.vocab_size, config.dim)
            self.position = nn.Embedding(config.max_seq_len, config.dim)
            self.blocks = nn.ModuleList(_Block(config.dim, config.n_heads) for _ in range(config.n_layers))
            self.norm = nn.LayerNorm(config.dim)
            self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        finally:
            torch.random.set_rng_state(generator_state)
        self.to(config.torch_dtype)

    def new_cache(self, tokens: int | None = None, device: torch.device | str | None = None) -> torch.Tensor:
        """A KV cache: [n_layers, 2, tokens, dim]."""
        cfg = self.config
        device = device if device is not None else self.head.weight.device
        return torch.zeros(
            cfg.n_layers, 2, tokens or cfg.max_seq_len, cfg.dim, dtype=cfg.torch_dtype, device=device
        )

    def forward(
        self, tokens: torch.Tensor, cache: torch.Tensor | None = None, start: int = 0
    ) -> torch.Tensor:
        """Logits [T, vocab] for a 1-D token sequence at positions start..start+T-1."""
        if cache is None:
            cache = self.new_cache(start + tokens.shape[0], tokens.device)
        positions = torch.arange(start, start + tokens.shape[0], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for i, block in enumerate(self.blocks):
            x = block(x, cache[i], start)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits

    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, cache: torch.Tensor | None = None
    ) -> list[list[int]]:
        """Greedy continuation of each prompt (new tokens only), reusing `cache` if given."""
        device = self.head.weight.device
        out = []
        for prompt in prompts:
            if not prompt:
                raise ValueError("TinyLM.generate: empty prompt")
            total = len(prompt) + max_new_tokens
            if total > self.config.max_seq_len:
                raise ValueError(
                    f"TinyLM.generate: prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds "
                    f"max_seq_len={self.config.max_seq_len}"
                )
            kv = cache if cache is not None else self.new_cache(total)
            if kv.shape[2] < total:
                raise ValueError(f"TinyLM.generate: the KV cache holds {kv.shape[2]} tokens, {total} needed")
            tokens = torch.tensor(list(prompt), dtype=torch.long, device=device)
            logits = self(tokens, kv, 0)
            new: list[int] = []
            position = len(prompt)
            for _ in range(max_new_tokens):
                token = int(logits[-1].float().argmax())
                new.append(token)
                logits = self(torch.tensor([token], device=device), kv, position)
                position += 1
            out.append(new)
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update carries (detached parameters)."""
        return {name: p.detach() for name, p in self.named_parameters()}


def weights_checksum(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    digest = hashlib.sha256()
    for name in sorted(items):
        tensor = items[name].detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()

"""`QwenLM`: a plain-torch Qwen2/Qwen3 causal LM with Hugging Face's parameter names, shapes and math.

Its weights load unchanged through SGLang's `Qwen2ForCausalLM`/`Qwen3ForCausalLM` weight loaders (and
through transformers' own classes), so a trainer can train it and push its `named_weights()` into a
real engine serving the same `config.json`.

    config = QwenConfig.from_json("configs/qwen2-tiny")
    model = QwenLM(config, seed=0)            # on the default device, in config.torch_dtype
    logits = model(torch.tensor([1, 2, 3]))   # [3, vocab]

No KV cache: `generate` recomputes the whole prefix every step, which suits tiny models only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["QwenConfig", "QwenLM"]

_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_POSITIVE_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)
# The keys `from_dict` needs; head_dim is derived for qwen2 (as transformers and SGLang derive it).
_REQUIRED = (
    "architectures",
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "max_position_embeddings",
)


@dataclass(frozen=True, kw_only=True)
class QwenConfig:
    """The fields of a Hugging Face Qwen2/Qwen3 `config.json` that decide the weights and the math."""

    model_type: str  # "qwen2" or "qwen3"
    architectures: tuple[str, ...]
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    torch_dtype: str
    source: str = field(default="QwenConfig", compare=False)  # where it was read, for error messages

    def __post_init__(self) -> None:
        where = self.source
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(
                f"{where}: unknown model_type={self.model_type!r}; QwenLM builds 'qwen2' or 'qwen3' "
                "checkpoints: use a Qwen2 or Qwen3 config.json"
            )
        expected = _ARCHITECTURES[self.model_type]
        if tuple(self.architectures) != (expected,):
            raise ValueError(
                f"{where}: architectures={list(self.architectures)!r} does not match "
                f"model_type={self.model_type!r}; SGLang picks its model class from architectures: "
                f'set it to ["{expected}"]'
            )
        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{where}: {name}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{where}: num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}; grouped-query attention shares each kv "
                "head among a whole number of query heads: pick a divisor"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"{where}: head_dim={self.head_dim} is odd; rotary embeddings rotate pairs of "
                "dimensions: use an even head_dim"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{where}: {name}={value!r} must be a positive number")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(
                f"{where}: tie_word_embeddings={self.tie_word_embeddings!r} must be true or false"
            )
        if self.torch_dtype not in _DTYPES:
            raise ValueError(
                f"{where}: torch_dtype={self.torch_dtype!r} is not one of {', '.join(_DTYPES)}; set one"
            )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.torch_dtype]

    @property
    def attention_bias(self) -> bool:
        """q/k/v projection biases: Qwen2 has them, Qwen3 has none."""
        return self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm over each head's query and key (Qwen3)."""
        return self.model_type == "qwen3"

    @classmethod
    def from_json(cls, path: str | Path) -> QwenConfig:
        """Read `path`, a `config.json` or the directory holding one."""
        file = Path(path)
        if file.is_dir():
            file = file / "config.json"
        if not file.is_file():
            raise ValueError(f"{file}: no such file; pass a Hugging Face config.json or its directory")
        try:
            data = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file}: not valid JSON ({e}); fix the file") from e
        if not isinstance(data, dict):
            raise ValueError(f"{file}: holds a {type(data).__name__}, not a JSON object of config keys")
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> QwenConfig:
        """Read the keys of a Hugging Face Qwen2/Qwen3 config; refuses features QwenLM does not model."""
        missing = [key for key in _REQUIRED if key not in data]
        if "rope_theta" not in data and "rope_theta" not in (data.get("rope_parameters") or {}):
            missing.append("rope_theta")
        if "torch_dtype" not in data and "dtype" not in data:
            missing.append("torch_dtype")
        model_type = data.get("model_type")
        if model_type == "qwen3" and "head_dim" not in data:
            missing.append("head_dim")
        if missing:
            raise ValueError(
                f"{source}: missing {', '.join(repr(key) for key in missing)}; add them as a Hugging Face "
                "Qwen2/Qwen3 config.json has them"
            )
        rope = data.get("rope_parameters") or {}
        unsupported = (
            ("hidden_act", data.get("hidden_act", "silu") != "silu", "QwenLM's MLP is SiLU-gated: set silu"),
            (
                "use_sliding_window",
                bool(data.get("use_sliding_window")),
                "QwenLM attends over the whole prefix: set it false",
            ),
            (
                "rope_scaling",
                data.get("rope_scaling") is not None,
                "QwenLM applies plain rotary embeddings: remove the scaling",
            ),
            (
                "rope_parameters",
                rope.get("rope_type", "default") != "default",
                "QwenLM applies plain rotary embeddings: use rope_type 'default'",
            ),
            (
                "attention_bias",
                model_type == "qwen3" and bool(data.get("attention_bias")),
                "QwenLM builds Qwen3 without attention biases, as Qwen3's checkpoints are: set it false",
            ),
            (
                "attention_dropout",
                bool(data.get("attention_dropout", 0.0)),
                "QwenLM has no dropout: set it 0.0",
            ),
        )
        for key, refused, what_to_do in unsupported:
            if refused:
                raise ValueError(f"{source}: {key}={data[key]!r} is not supported; {what_to_do}")
        hidden, heads = data["hidden_size"], data["num_attention_heads"]
        head_dim: Any = data.get("head_dim")
        sizes_are_ints = all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (hidden, heads)
        )
        if head_dim is None and sizes_are_ints:
            if hidden % heads:
                raise ValueError(
                    f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={heads} "
                    "(Qwen2 derives head_dim = hidden_size / num_attention_heads): pick sizes that divide "
                    "or set head_dim"
                )
            head_dim = hidden // heads
        architectures = data["architectures"]
        rope_theta = data.get("rope_theta", rope.get("rope_theta"))
        return cls(
            model_type=model_type if isinstance(model_type, str) else repr(model_type),
            architectures=tuple(architectures) if isinstance(architectures, list) else (str(architectures),),
            hidden_size=hidden,
            intermediate_size=data["intermediate_size"],
            num_hidden_layers=data["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=data["num_key_value_heads"],
            head_dim=head_dim,
            vocab_size=data["vocab_size"],
            rms_norm_eps=data["rms_norm_eps"],
            rope_theta=float(rope_theta) if isinstance(rope_theta, int) else rope_theta,
            tie_word_embeddings=data["tie_word_embeddings"],
            max_position_embeddings=data["max_position_embeddings"],
            torch_dtype=data.get("torch_dtype", data.get("dtype")),
            source=source,
        )


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As transformers: normalize in float32, cast back, then scale in the input's dtype.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out: torch.Tensor = self.weight * h.to(x.dtype)
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Attention(nn.Module):
    def __init__(self, config: QwenConfig, dtype: torch.dtype) -> None:
        super().__init__()
        c, hd = config, config.head_dim
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, hd
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * hd, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False, dtype=dtype)
        self.q_norm = _RMSNorm(hd, c.rms_norm_eps, dtype) if c.qk_norm else None
        self.k_norm = _RMSNorm(hd, c.rms_norm_eps, dtype) if c.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [B, T, hidden]; cos, sin: [T, head_dim]."""
        batch, steps, _ = x.shape
        q = self.q_proj(x).view(batch, steps, self.heads, self.head_dim)
        k = self.k_proj(x).view(batch, steps, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, steps, self.kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        # kv head j serves query heads j*groups .. (j+1)*groups-1, as transformers' repeat_kv.
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)
        out: torch.Tensor = self.o_proj(attended.transpose(1, 2).reshape(batch, steps, -1))
        return out


class _MLP(nn.Module):
    def __init__(self, config: QwenConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, width = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, width, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(width, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _DecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig, dtype: torch.dtype) -> None:
        super().__init__()
        # Registered in transformers' order, so that named_parameters() lists them as its model does.
        self.self_attn = _Attention(config, dtype)
        self.mlp = _MLP(config, dtype)
        self.input_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Backbone(nn.Module):
    def __init__(self, config: QwenConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = _RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class QwenLM(nn.Module):
    """A Qwen2/Qwen3 causal LM named and computed as transformers' `Qwen2ForCausalLM`/`Qwen3ForCausalLM`.

    Built on `device` (default: the current default device; under `torch.device("meta")` nothing is
    allocated) in `dtype` (default: the config's), its weights drawn from `seed` by a local generator
    on the CPU, so equal seeds give equal weights on any device and the global RNG is untouched.
    """

    def __init__(
        self,
        config: QwenConfig,
        *,
        seed: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.config, self.seed = config, seed
        dtype = dtype or config.dtype
        target = torch.device(device) if device is not None else torch.get_default_device()
        # Built on the meta device so that nn.Linear's own initialization draws nothing.
        with torch.device("meta"):
            self.model = _Backbone(config, dtype)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            )
        hd = config.head_dim
        self._inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device="cpu") / hd)
        )
        if target.type != "meta":
            self.to_empty(device=target)
            self._initialize(seed)

    @torch.no_grad()
    def _initialize(self, seed: int) -> None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
        for module in self.modules():
            if isinstance(module, _RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                drawn = torch.empty(module.weight.shape, dtype=torch.float32, device="cpu")
                drawn.normal_(0.0, 0.02, generator=generator)
                module.weight.copy_(drawn)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()

    def _rotary(
        self, steps: int, device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # As transformers: angles in float32 from inverse frequencies computed on the CPU, cast to the
        # activations' dtype; the two halves of each head share a frequency (rotate_half convention).
        positions = torch.arange(steps, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self._inv_freq.to(device)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] for a 1-D token sequence at positions 0..T-1, or [B, T, vocab] for [B, T]."""
        if tokens.dim() not in (1, 2):
            raise ValueError(f"QwenLM: tokens of shape {tuple(tokens.shape)}; pass [T] or [B, T] token ids")
        batch = tokens if tokens.dim() == 2 else tokens[None]
        steps = batch.shape[1]
        if steps > self.config.max_position_embeddings:
            raise ValueError(
                f"QwenLM: {steps} tokens exceed max_position_embeddings={self.config.max_position_embeddings}; "
                "pass a shorter sequence"
            )
        x = self.model.embed_tokens(batch)
        cos, sin = self._rotary(steps, x.device, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        head = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = F.linear(x, head)
        return logits if tokens.dim() == 2 else logits[0]

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int) -> list[list[int]]:
        """Greedy continuation of each prompt (new tokens only), recomputing the whole prefix each step."""
        if max_new_tokens < 0:
            raise ValueError(f"QwenLM.generate: max_new_tokens={max_new_tokens} must be >= 0")
        device, vocab = self.model.embed_tokens.weight.device, self.config.vocab_size
        out = []
        for prompt in prompts:
            if not prompt:
                raise ValueError("QwenLM.generate: empty prompt; pass at least one token id")
            outside = [t for t in prompt if not 0 <= t < vocab]
            if outside:
                raise ValueError(
                    f"QwenLM.generate: token ids {outside[:5]} are outside the vocabulary [0, {vocab})"
                )
            total = len(prompt) + max_new_tokens
            if total > self.config.max_position_embeddings:
                raise ValueError(
                    f"QwenLM.generate: prompt of {len(prompt)} + {max_new_tokens} new tokens exceeds "
                    f"max_position_embeddings={self.config.max_position_embeddings}"
                )
            tokens = list(prompt)
            for _ in range(max_new_tokens):
                logits = self(torch.tensor(tokens, dtype=torch.long, device=device))
                tokens.append(int(logits[-1].float().argmax()))
            out.append(tokens[len(prompt) :])
        return out

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update carries (detached parameters), named as the HF checkpoint."""
        return {name: p.detach() for name, p in self.named_parameters()}

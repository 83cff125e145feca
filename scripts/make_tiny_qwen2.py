#!/usr/bin/env python3
"""A tiny Qwen2-shaped model, its tokenizer and a prompt set, made locally (no hub), for slime's own job.

    python scripts/make_tiny_qwen2.py OUT [--hidden 256 --layers 2 --vocab 2048 --prompts 256 --seed 1234]

writes `OUT/model/` (config.json, random bf16 weights as safetensors, a byte-level BPE tokenizer
trained on the prompts' text, with Qwen's chat template: what slime's actor, Megatron's tokenizer and
SGLang load through AutoConfig/AutoTokenizer) and `OUT/prompts.jsonl` (`{"prompt": ..., "label": ...}`,
integer arithmetic whose answer a rule reward checks with no network: slime's `--input-key prompt
--label-key label`). bf16 matters: slime's `--check-weight-update-equal` compares bit for bit.
Needs torch, transformers and tokenizers (a CPU is enough). The launch it is made for:
docs/frameworks/slime.md; `scripts/slime_e2e.sh` calls this.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's chat template, reduced to the roles a prompt set uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def prompts(count: int, seed: int) -> list[dict[str, str]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice(["+", "-", "*"])
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(
            {
                "prompt": f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}.",
                "label": str(answer),
            }
        )
    return out


def tokenizer(corpus: list[str], vocab: int, directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(directory)
    return len(fast)


def model(vocab: int, hidden: int, layers: int, directory: Path, seed: int, eos: int, pad: int) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        dtype="bfloat16",
    )
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)


def _readable_by_older_transformers(directory: Path) -> None:
    """transformers 5 writes `dtype`, `rope_parameters`, its own tokenizer class and the chat template in a
    file of its own; SGLang's and Megatron's transformers 4.x read `torch_dtype`, `rope_theta`, a fast
    tokenizer class and the template inline. Both spellings are written."""
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config.setdefault("torch_dtype", config.get("dtype", "bfloat16"))
    config.setdefault("dtype", config["torch_dtype"])
    rope = config.get("rope_parameters") or {}
    config.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.hidden % 64 and args.hidden >= 64:
        parser.error(f"--hidden {args.hidden}: use a multiple of 64 (the heads are 64 wide)")
    model_dir = args.out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    data = prompts(args.prompts, args.seed)
    with (args.out / "prompts.jsonl").open("w") as f:
        for row in data:
            f.write(json.dumps(row) + "\n")
    corpus = [row["prompt"] + " " + row["label"] for row in data] * 4
    vocab = tokenizer(corpus, args.vocab, model_dir)
    ids = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    padded = (vocab + 63) // 64 * 64  # Megatron pads the embedding to a multiple; keep HF's divisible too
    model(padded, args.hidden, args.layers, model_dir, args.seed, ids["<|im_end|>"], ids["<|endoftext|>"])
    _readable_by_older_transformers(model_dir)
    print(
        f"wrote {model_dir} (vocab {padded}, hidden {args.hidden}, {args.layers} layers) and {len(data)} prompts"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

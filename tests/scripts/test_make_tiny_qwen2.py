"""scripts/make_tiny_qwen2.py: a tiny Qwen2 model, its tokenizer and a prompt set, made with no network."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_what_it_writes_loads_through_autoconfig_and_autotokenizer_with_bf16_weights(tmp_path: Path) -> None:
    transformers = __import__("pytest").importorskip("transformers")
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "make_tiny_qwen2.py"),
            str(tmp_path),
            "--hidden",
            "64",
            "--layers",
            "1",
            "--vocab",
            "300",
            "--prompts",
            "4",
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    config = transformers.AutoConfig.from_pretrained(tmp_path / "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "model")
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 64, 1)
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tokenizer)
    raw = json.loads((tmp_path / "model" / "config.json").read_text())
    assert (
        raw["torch_dtype"] == raw["dtype"] == "bfloat16" and raw["rope_theta"] == 10000.0
    )  # transformers 4.x reads these
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    rows = [json.loads(line) for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(
        set(r) == {"prompt", "label"} and r["label"].lstrip("-").isdigit() for r in rows
    )
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as weights:
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {"torch.bfloat16"}  # noqa: SIM118 - safe_open has keys(), no iteration

"""Small plain-torch models the demo, tests and benchmarks train and sync: `tiny` (`TinyLM`) and
`qwen2` (`QwenLM`, Hugging Face Qwen2/Qwen3 names, shapes and math, loadable by SGLang).
"""

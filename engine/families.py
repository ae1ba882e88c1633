"""The model families tandem runs: each Hugging Face `model_type` and the module under `engine.models`
whose `MODEL` class runs it.

Pure data, so that `engine.config` can refuse an unknown `model_type` at start from a process that never
builds a model (the decode front door reads configs too) without loading any model code.
"""

# model_type -> the module under `engine.models` whose `MODEL` class runs it.
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "mixtral": "mixtral",
    "qwen3_moe": "qwen3_moe",
}

"""Opening a model's weights for streaming: a safetensors directory or a GGUF file.

Apart from `engine.model_store` (which finds checkpoints and reads their configs) because a GGUF's
weights come out as the kernels' Q8_0 blocks: what only reads a model's facts, such as the decode front
door, must not load the kernels.
"""

from __future__ import annotations

from pathlib import Path

from engine.checkpoint_stream import Checkpoint, read_shards
from engine.gguf_checkpoint import GgufCheckpoint
from engine.gguf_metadata import gguf_hf_config
from engine.model_store import checkpoint_dir, load_hf_config, safetensors_shards


def open_checkpoint(path: Path) -> Checkpoint | GgufCheckpoint:
    """A checkpoint's config and the names in each safetensors shard, its weights left on disk for
    `Checkpoint.tensors` to stream (`engine.checkpoint_stream`), keeping the HF parameter names.

    With tied embeddings the checkpoint usually has no `lm_head.weight`; the model ties it to
    `model.embed_tokens.weight` (we report what is on disk and invent nothing). Raises
    ModelNotFoundError for a missing or unreadable checkpoint or one whose shards repeat a tensor;
    streaming raises its NonFiniteWeightsError for NaN or infinite weights (which would be served as
    empty text).
    """
    path = checkpoint_dir(Path(path))
    if path.is_file():
        return GgufCheckpoint(path, gguf_hf_config(path))
    return Checkpoint(path, load_hf_config(path), read_shards(safetensors_shards(path)))

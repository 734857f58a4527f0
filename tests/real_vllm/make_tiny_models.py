"""Build the lane's tiny models locally: random weights (seed 0), a tokenizer trained here.

    python tests/real_vllm/make_tiny_models.py llama OUT_DIR
    python tests/real_vllm/make_tiny_models.py qwen2vl OUT_DIR
    python tests/real_vllm/make_tiny_models.py qwen2audio OUT_DIR

Nothing is downloaded.  Both builds are deterministic for a given torch and
tokenizers release, which is what lets the lane compare logprobs with recorded
golden values.  The shapes respect vLLM's CPU kernels: attention head size 32,
for Qwen2-VL an ``mrope_section`` that sums to half the head size, and for
Qwen2-Audio a Whisper-style encoder on 128 mel bins at 16 kHz.  The
weights are random, so the text they generate is gibberish: tests assert on
logprobs, token counts and metrics, never on words.

Runs inside the lane's virtualenv (torch, transformers, tokenizers).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Describe this image in one sentence.",
    "Encode, prefill and decode run on separate workers.",
    "A router streams tokens back to the client over HTTP.",
    "One two three four five six seven eight nine ten.",
]


def train_tokenizer(special: list[str], **named_tokens: str) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **named_tokens)


def build_llama(out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = train_tokenizer(
        ["<s>", "</s>", "<pad>"], bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    # ``preamble``: a template variable for the matrix's chat_template_kwargs case (vLLM passes
    # a kwarg on only when the template reads it); without it the rendering is unchanged.
    tokenizer.chat_template = (
        "{% if preamble is defined %}{{ preamble }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)


def build_qwen2vl(out: Path) -> None:
    import torch
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ]
    tokenizer = train_tokenizer(special, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    # Content given as a list of parts: text is written out, each image or video becomes the
    # vision placeholder that vLLM expands to the item's tokens.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url'] %}"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif part['type'] in ['video', 'video_url'] %}"
        "<|vision_start|><|video_pad|><|vision_end|>{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.save_pretrained(out)
    # One language-model token per 28x28 pixels (patch 14, merge 2): 4 to 16 tokens an image.
    processor = Qwen2VLImageProcessorPil(
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 16,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    )
    processor.save_pretrained(out)
    # The same bounds for video frames (vLLM reads video_preprocessor_config.json): a 56x56
    # frame stays 56x56, so four frames are 2 temporal patches of 2x2 merged tokens.
    Qwen2VLVideoProcessor(
        min_pixels=28 * 28 * 4,
        max_pixels=28 * 28 * 16,
        patch_size=14,
        merge_size=2,
        temporal_patch_size=2,
    ).save_pretrained(out)
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [4, 6, 6],
            },
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 64,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).to(torch.bfloat16).save_pretrained(out)


def build_qwen2audio(out: Path) -> None:
    """Qwen2-Audio: a Whisper-style encoder (1 layer, 64 wide) and a Qwen2 language model.

    vLLM's Qwen2-Audio processor pads every clip to 30 s of 128-bin log-mel frames (3000),
    the encoder's 1500 positions; each second of audio becomes 25 language-model tokens.
    """
    import torch
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration
    from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor
    from transformers.models.whisper.feature_extraction_whisper import WhisperFeatureExtractor

    special = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|audio_bos|>",
        "<|AUDIO|>",
        "<|audio_eos|>",
    ]
    tokenizer = train_tokenizer(special, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in special}
    # Each audio part becomes the placeholder that vLLM expands to the clip's tokens (the
    # form of Qwen2-Audio's own template).
    chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['audio', 'audio_url', 'input_audio'] %}"
        "<|audio_bos|><|AUDIO|><|audio_eos|>{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer.chat_template = chat_template
    feature_extractor = WhisperFeatureExtractor(
        feature_size=128, sampling_rate=16000, hop_length=160, chunk_length=30, n_fft=400
    )
    Qwen2AudioProcessor(
        feature_extractor=feature_extractor, tokenizer=tokenizer, chat_template=chat_template
    ).save_pretrained(out)
    tokenizer.save_pretrained(out)
    config = Qwen2AudioConfig(
        audio_config={
            "num_mel_bins": 128,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            "max_source_positions": 1500,
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": 512,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 4096,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "tie_word_embeddings": False,
        },
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out)
    write_published_layout(model.state_dict(), out)


# Where transformers 5 keeps each part of Qwen2-Audio in memory, and where the published
# checkpoints (and vLLM's loader) have it.  transformers 4 already uses the published names.
_PUBLISHED_PREFIXES = (
    ("model.language_model.", "language_model.model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("lm_head.", "language_model.lm_head."),
)


def published_name(key: str) -> str:
    """A Qwen2-Audio weight's name in the published checkpoints' layout."""
    for in_memory, published in _PUBLISHED_PREFIXES:
        if key.startswith(in_memory):
            return published + key[len(in_memory) :]
    return key


def write_published_layout(state: dict[str, Any], out: Path) -> None:
    """Replace the saved weights by ``state`` under the published checkpoints' names.

    transformers 5.19 writes Qwen2-Audio's language model as
    ``language_model.model.model.*``, which vLLM's loader cannot place ("no module or
    parameter named 'model' in Qwen2Model").  The weights are the same tensors.
    """
    from safetensors.torch import save_file

    for saved in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        saved.unlink()
    weights = {published_name(key): tensor.contiguous() for key, tensor in state.items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})


BUILDERS = {"llama": build_llama, "qwen2vl": build_qwen2vl, "qwen2audio": build_qwen2audio}
BUILD_VERSION = {"llama": 2, "qwen2vl": 2, "qwen2audio": 2}
"""Bumped when a builder's output changes, so that setup_lane.sh rebuilds an older model
(llama 2: a ``preamble`` variable in its template; qwen2vl 2: the video placeholder in its
template and its video processor; qwen2audio 2: its weights under the published checkpoints'
names)."""


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--version" and sys.argv[2] in BUILD_VERSION:
        print(BUILD_VERSION[sys.argv[2]])
        return 0
    if len(sys.argv) != 3 or sys.argv[1] not in BUILDERS:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    BUILDERS[sys.argv[1]](out)
    print(f"make_tiny_models: {sys.argv[1]} written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

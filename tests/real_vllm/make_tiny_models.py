"""Build the lane's tiny models locally: random weights (seed 0), a tokenizer trained here.

    python tests/real_vllm/make_tiny_models.py llama OUT_DIR
    python tests/real_vllm/make_tiny_models.py qwen2vl OUT_DIR

Nothing is downloaded.  Both builds are deterministic for a given torch and
tokenizers release, which is what lets the lane compare logprobs with recorded
golden values.  The shapes respect vLLM's CPU kernels: attention head size 32,
and for Qwen2-VL an ``mrope_section`` that sums to half the head size.  The
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
    tokenizer.chat_template = (
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
    # Content given as a list of parts: text is written out, each image becomes the vision
    # placeholder that vLLM expands to the image's tokens.
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}"
        "{% elif part['type'] in ['image', 'image_url'] %}"
        "<|vision_start|><|image_pad|><|vision_end|>{% endif %}"
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


BUILDERS = {"llama": build_llama, "qwen2vl": build_qwen2vl}


def main() -> int:
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

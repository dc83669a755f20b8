"""Tiny models built from a config, and tokenizers made locally: a character-level one, and a byte-level BPE
trained on given texts with a ChatML chat template (as Qwen2's chat models use).

Nothing here downloads anything: tests, the shipped default model and the chat example use these builders.
"""

from __future__ import annotations

import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
DEFAULT_CHARS = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer(chars: str = DEFAULT_CHARS, pad_is_eos: bool = False) -> PreTrainedTokenizerFast:
    """A character-level tokenizer: one token per character, plus <pad> <s> </s> (ids 0, 1, 2).

    `pad_is_eos=True` makes the pad token the EOS token, as many real tokenizers do, to test that
    nothing derives the response mask from `pad_token_id`. Padding is on the left, for generation.
    """
    specials = [PAD, BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in dict.fromkeys(chars):  # ordered, unique
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS if pad_is_eos else PAD,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return fast


# ChatML, the format of Qwen2's chat models: each message between <|im_start|>ROLE and <|im_end|>, the
# assistant's turn opened by the generation prompt; the model ends its answer with <|im_end|> (its EOS)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML as a reasoning model's template writes it (DeepSeek-R1's way): the generation prompt opens the reasoning
# (<think>), and an earlier assistant turn is written without it (what its content holds after </think>)
REASONING_TEMPLATE = (
    "{% for message in messages %}{% set content = message['content'] or '' %}"
    "{% if message['role'] == 'assistant' and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
# The shipped tiny-reasoner's chat format (`scripts/make_tiny_model.py --task reasoner`), plain characters for a
# character-level tokenizer: "U:" a user message, "A:" an assistant message, each ending at a new line. The generation
# prompt opens the reasoning, "A:<think>"; an earlier assistant turn is written without it, as DeepSeek-R1's template
# does (REASONER_TEMPLATE), or with it, as it was sampled (REASONER_KEEP_TEMPLATE, for comparison).
REASONER_TEMPLATE = (
    "{% for m in messages %}{% set c = m['content'] or '' %}"
    "{% if m['role'] == 'assistant' %}{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ 'A:' + c + '\\n' }}{% else %}{{ 'U:' + c + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:<think>' }}{% endif %}"
)
REASONER_KEEP_TEMPLATE = (
    "{% for m in messages %}{% set c = m['content'] or '' %}"
    "{% if m['role'] == 'assistant' %}{{ 'A:<think>' + c + '\\n' }}{% else %}{{ 'U:' + c + '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'A:<think>' }}{% endif %}"
)
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def bpe_chat_tokenizer(texts: list[str], vocab_size: int = 512, chat_template: str = CHATML_TEMPLATE
                       ) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on `texts` (seconds on a CPU), with ChatML's special tokens and
    chat template (or `chat_template`: `REASONING_TEMPLATE`): EOS is `<|im_end|>`, padding `<|endoftext|>` on the
    left, no BOS (as Qwen2's).

    Byte-level: any text encodes, whatever characters the training texts had.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
    )


def tiny_causal_lm(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    seed: int = 0,
):
    """A randomly initialised Llama-, Qwen2- or Qwen3-architecture causal LM sized for tests."""
    import torch

    cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
    if arch not in cls:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose one of {sorted(cls)}")
    config_cls, model_cls = cls[arch]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval()


IMAGE_TOKEN = "<image>"
# messages whose content is a string or a list of text and image parts, each image part as `<image>`
PARTS_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<image>' }}{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def tiny_llava(
    tokenizer: PreTrainedTokenizerFast | None = None,
    image_size: int = 32,
    patch_size: int = 8,
    hidden_size: int = 64,
    num_layers: int = 2,
    seed: int = 0,
    vision_hidden_size: int = 32,
    vision_layers: int = 1,
):
    """A randomly initialised LLaVA sized for tests: a CLIP vision tower on `image_size` images cut in
    `patch_size` patches (CLS dropped: `(image_size / patch_size)**2` image tokens, 16 by default), a
    two-layer MLP projector, a tiny Llama; and its processor (Pillow's CLIP image processor: no torchvision).

    Returns (model, processor). The tokenizer (default: `char_tokenizer()`) gets `<image>` as a special token.
    `vision_hidden_size` and `vision_layers` size the CLIP tower (2 heads); the shipped `tiny-vision` is larger
    than the tests' default.
    """
    import torch
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = tokenizer or char_tokenizer()
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    images = CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=PARTS_TEMPLATE)
    vision = CLIPVisionConfig(hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                              num_hidden_layers=vision_layers, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size)
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                         vision_feature_select_strategy="default", vision_feature_layer=-1)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), processor


def tiny_qwen2_vl(hidden_size: int = 64, num_layers: int = 2, seed: int = 0):
    """A randomly initialised Qwen2-VL sized for tests: a one-block vision tower on 8-pixel patches merged 2x2
    (a 32x32 image is 4 image tokens, a 64x32 one 8), M-RoPE sections (2, 3, 3) on a tiny Qwen2 decoder;
    and Qwen2-VL's processor for images (`lmrl.models.qwen_vl.QwenVLImageProcessor`: transformers' own needs
    torchvision) over Pillow's Qwen2-VL image processor and a char tokenizer.

    Returns (model, processor).
    """
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = char_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(zip(specials, tokenizer.convert_tokens_to_ids(specials)))
    images = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8, merge_size=2,
                                      temporal_patch_size=2)
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)
    vision = dict(depth=1, embed_dim=32, hidden_size=hidden_size, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    from lmrl.models.qwen_vl import QwenVLImageProcessor

    return model.eval(), QwenVLImageProcessor(images, tokenizer)


def tiny_idefics3(hidden_size: int = 128, num_heads: int = 2, num_layers: int = 2, seed: int = 0):
    """A randomly initialised Idefics3 (SmolVLM's architecture) sized for tests: a SigLIP tower on 32x32 images
    in 8-pixel patches, pixel-shuffled 2x2 (4 image tokens each, between `<fake_token_around_image>` tokens),
    on a tiny Llama whose head dim (64) vLLM's CPU attention supports; with transformers' own processor over
    Pillow's Idefics3 image processor (no image splitting). vLLM's CPU build loads this architecture here.

    Returns (model, processor).
    """
    import torch
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = char_tokenizer()
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]  # the processor looks them up
    specials = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>", *grid]
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 32},
                                       do_image_splitting=False)
    processor = Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4)
    text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=hidden_size,
                intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                num_key_value_heads=num_heads, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
                            pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), processor

"""Vision-language policies (lmrl.models.vision): a tiny LLaVA built here (CLIP tower on 32x32 images, patch 8,
on a tiny Llama), loaded through AutoModelForImageTextToText + AutoProcessor, each prompt's images processed
once, and lmrl's decode sampling from it with the log-probs a plain forward gives."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from lmrl.models.tiny import IMAGE_TOKEN, tiny_llava
from lmrl.models.vision import batch_media, encode_with_media, load_vision_model, takes_images
from lmrl.rollout import HFGenerator, SamplingParams

PROMPTS = [f"{IMAGE_TOKEN}what is it?", f"{IMAGE_TOKEN}{IMAGE_TOKEN}which is larger?", "no image: 1+1="]


def drawn(value: int) -> Image.Image:
    """A 20x28 image (resized to 32x32 by the processor) with `value` in its red channel and a bright stripe."""
    image = Image.new("RGB", (20, 28), (value, 40, 200 - value))
    for i in range(20):
        image.putpixel((i, value % 28), (255, 255, 255))
    return image


IMAGES = [[drawn(10)], [drawn(100), drawn(200)], []]


@pytest.fixture(scope="module")
def llava():
    model, processor = tiny_llava(seed=0)
    with torch.no_grad():  # a fresh init repeats its input: perturb so that outputs depend on what it sees
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model, processor


def forward_logprobs(model, prompt_ids, media, response_ids, length):
    """Log-probs of the response tokens under one plain forward of prompt + response, with the prompt's images."""
    ids = torch.tensor([prompt_ids + response_ids[:length]])
    with torch.no_grad():
        logits = model(input_ids=ids, **(media or {})).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(1, ids[0, len(prompt_ids) :, None]).squeeze(1)


def test_each_image_is_16_tokens_and_a_bundle_per_prompt(llava):
    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    image_id = model.config.image_token_index
    assert [row.count(image_id) for row in ids] == [16, 32, 0]
    assert media[2] is None
    assert [m["pixel_values"].shape for m in media[:2]] == [(1, 3, 32, 32), (2, 3, 32, 32)]
    batch = batch_media(media)
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    torch.testing.assert_close(batch["pixel_values"][1:], media[1]["pixel_values"])
    assert batch_media([None, None]) == {} and takes_images(model)
    with pytest.raises(ValueError, match="3 prompts"):
        encode_with_media(processor, PROMPTS, IMAGES[:2])


def test_saved_and_loaded_through_the_auto_classes(llava, tmp_path):
    model, processor = llava
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded, loaded_processor = load_vision_model(str(tmp_path))
    assert type(loaded).__name__ == "LlavaForConditionalGeneration"
    ids, media = encode_with_media(loaded_processor, PROMPTS[:1], IMAGES[:1])
    assert ids == encode_with_media(processor, PROMPTS[:1], IMAGES[:1])[0]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=torch.tensor(ids), **media[0]).logits,
                                   model(input_ids=torch.tensor(ids), **media[0]).logits)


def test_decode_with_images_matches_a_plain_forward_and_sees_the_images(llava):
    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    seen = []
    hook = model.model.vision_tower.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[0]))
    try:
        rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
            ids, 4, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0), media=media)
    finally:
        hook.remove()
    assert seen == [3]  # one prefill of the 3 prompts' 3 images, not one per completion (4 each)
    assert rollout.response_ids.shape == (12, 6)
    for row in range(12):
        p = row // 4
        expected = forward_logprobs(model, ids[p], media[p], rollout.response_ids[row].tolist(), 6)
        torch.testing.assert_close(rollout.logprobs[row], expected, atol=1e-5, rtol=0)
    # the same prompt with another image: other first-token distributions (the image reaches the logits)
    other = encode_with_media(processor, PROMPTS[:1], [[drawn(230)]])[1]
    with torch.no_grad():
        a = model(input_ids=torch.tensor(ids[:1]), **media[0]).logits[0, -1]
        b = model(input_ids=torch.tensor(ids[:1]), **other[0]).logits[0, -1]
    assert (a - b).abs().max() > 1e-3


def test_rows_with_and_without_images_in_one_chunk_and_in_several(llava):
    """One forward batch or one chunk per prompt: the same samples (the bundles follow their prompts)."""
    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    params = SamplingParams(max_new_tokens=5, temperature=0.0)
    whole = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(ids, 2, params, media=media)
    split = HFGenerator(model, processor.tokenizer, eos_token_id=[], batch_size=2).generate(ids, 2, params, media=media)
    assert torch.equal(whole.response_ids, split.response_ids)
    torch.testing.assert_close(whole.logprobs, split.logprobs, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="media: 2 bundles for 3 prompts"):
        HFGenerator(model, processor.tokenizer).generate(ids, 2, params, media=media[:2])


def test_the_training_forward_with_each_rows_images_scores_what_the_sampler_drew(llava):
    """Sampler vs trainer: the batch forward (left-padded rows, each with its prompt's images, whole or in
    micro-batches, any row order) gives the sampling log-probs, so the KL between them is ~0."""
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import row_media

    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    rollout = HFGenerator(model, processor.tokenizer).generate(
        ids, 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=3), media=media)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    T, mask = rollout.response_ids.shape[1], rollout.response_mask
    with torch.no_grad():
        whole = model_forward_logprobs(model, seqs, attn, T, media=row_media(media, rollout.prompt_index))
        order = torch.tensor([8, 0, 4, 5, 1, 7, 2, 3, 6])  # micro-batches of 3 rows from all prompts
        parts = torch.cat([model_forward_logprobs(model, seqs[rows], attn[rows], T,
                                                  media=row_media(media, rollout.prompt_index[rows]))
                           for rows in order.split(3)])
    kl = ((rollout.logprobs - whole) * mask).sum() / mask.sum()  # k1 estimate of KL(sampler || trainer)
    assert abs(kl.item()) < 1e-6
    torch.testing.assert_close(whole[mask], rollout.logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(parts[mask[order]], whole[order][mask[order]], atol=1e-5, rtol=0)


def test_padding_cannot_change_a_score(llava):
    """A row scored alone (no padding) and among longer prompts (left padding): the same log-probs."""
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import row_media

    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
        ids, 1, SamplingParams(max_new_tokens=4, temperature=1.0, seed=5), media=media)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    assert (attn[0] == 0).any() and (attn[2] == 0).any()  # the short prompts are padded
    with torch.no_grad():
        batch = model_forward_logprobs(model, seqs, attn, 4, media=row_media(media, [0, 1, 2]))
        for row in range(3):
            alone = seqs[row][attn[row].bool()][None]
            single = model_forward_logprobs(model, alone, torch.ones_like(alone), 4, media=row_media(media, [row]))
            torch.testing.assert_close(single[0], batch[row], atol=1e-5, rtol=0)


def test_a_frozen_vision_tower_gets_no_gradient_and_the_rest_finite_ones():
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import freeze_vision, row_media

    model, processor = tiny_llava(seed=2)
    frozen = freeze_vision(model)
    assert frozen and all(name.startswith("model.vision_tower.") for name in frozen)
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
        ids, 2, SamplingParams(max_new_tokens=3, temperature=1.0, seed=0), media=media)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    model.train()
    model_forward_logprobs(model, seqs, attn, 3, media=row_media(media, rollout.prompt_index)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(grads[n] is None for n in frozen)
    trained = [n for n in grads if n not in frozen]
    assert all(grads[n] is not None and torch.isfinite(grads[n]).all() for n in trained)
    projector = [grads[n].abs().sum() for n in trained if "multi_modal_projector" in n]
    assert projector and all(g > 0 for g in projector)  # the images' gradient reaches the projector


def test_the_fixed_shape_step_a_gpu_captures_samples_the_same(llava):
    """On CUDA the engine's decode steps are CUDA graphs of fixed shapes; the same steps run
    eagerly here (fixed_shapes=True) samples what the cache path samples, images and all."""
    model, processor = llava
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    cache = HFGenerator(model, processor.tokenizer).generate(ids, 3, params, media=media)
    fixed = HFGenerator(model, processor.tokenizer, fixed_shapes=True)
    assert fixed.decode_path()[0] == "fixed_shapes"
    out = fixed.generate(ids, 3, params, media=media)
    assert torch.equal(out.response_ids, cache.response_ids)
    torch.testing.assert_close(out.logprobs, cache.logprobs, atol=1e-5, rtol=0)


# --- Qwen2-VL style: 3-D rotary positions (M-RoPE) computed by the model, never 2-D position_ids ---------------


@pytest.fixture(scope="module")
def qwen2_vl():
    from lmrl.models.tiny import tiny_qwen2_vl

    model, processor = tiny_qwen2_vl(seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    token = processor.image_token
    prompts = [f"{token}what?", f"{token}and{token}which?", "plain 1+1="]
    images = [[Image.new("RGB", (64, 32), (10, 200, 3))], [drawn(100), Image.new("RGB", (64, 64), (0, 0, 200))], []]
    ids, media = encode_with_media(processor, prompts, images)
    return model, processor, ids, media


def own_positions_logprobs(model, prompt_ids, media, response_ids):
    """One unpadded row, positions left to the model (it computes M-RoPE from the image grid): the reference."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       **(media or {})).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(1, ids[0, len(prompt_ids) :, None]).squeeze(1)


def test_qwen2_vl_decode_and_training_forward_use_the_models_3d_positions(qwen2_vl):
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import mrope_positions, row_media, uses_mrope

    model, processor, ids, media = qwen2_vl
    assert uses_mrope(model) and [m["image_grid_thw"].shape[0] for m in media[:2]] == [1, 2] and media[2] is None
    rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
        ids, 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0), media=media)
    for row in range(6):
        expected = own_positions_logprobs(model, ids[row // 2], media[row // 2], rollout.response_ids[row].tolist())
        torch.testing.assert_close(rollout.logprobs[row], expected, atol=1e-5, rtol=0)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    batch = row_media(media, rollout.prompt_index)
    with torch.no_grad():
        trained = model_forward_logprobs(model, seqs, attn, 5, media=batch)
        # what a 2-D position_ids does: the model copies it to all three axes, and the scores move
        flat = model(input_ids=seqs, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0), **batch).logits
    kl = (rollout.logprobs - trained).mean()  # k1: sampler vs trainer
    assert abs(kl.item()) < 1e-6
    torch.testing.assert_close(trained, rollout.logprobs, atol=1e-5, rtol=0)
    positions = mrope_positions(model, seqs, attn, batch)
    assert positions.shape == (3, *seqs.shape) and not torch.equal(positions[1], positions[2])  # height != width
    flat_logp = torch.log_softmax(flat[:, -6:-1].float(), -1).gather(2, seqs[:, -5:, None]).squeeze(2)
    assert (flat_logp[:4] - trained[:4]).abs().max() > 1e-3  # the image rows: 2-D positions would be wrong


def test_qwen2_vl_frozen_tower_and_finite_gradients_elsewhere(qwen2_vl):
    import copy

    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import freeze_vision, row_media

    model, processor, ids, media = qwen2_vl
    model = copy.deepcopy(model)
    frozen = freeze_vision(model)
    assert frozen and all(name.startswith("model.visual.") for name in frozen)
    rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
        ids, 2, SamplingParams(max_new_tokens=3, temperature=1.0, seed=1), media=media)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    model.train()
    model_forward_logprobs(model, seqs, attn, 3, media=row_media(media, rollout.prompt_index)).sum().backward()
    grads = dict(model.named_parameters())
    assert all(grads[n].grad is None for n in frozen)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for n, p in grads.items() if n not in frozen)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_image_placeholder_is_never_sampled(llava, temperature):
    """A completion holding `<image>` would give the training forward more placeholders than images (TRL #3847):
    the sampler draws around it, and reports the full distribution's log-probs, as a plain forward scores them."""
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import media_token_ids, row_media

    model, processor = llava
    image_id = model.config.image_token_index
    assert media_token_ids(model) == [image_id]

    def favour_image(module, args, out):  # the image token takes nearly all the mass
        out = out.clone()
        out[..., image_id] += 30.0
        return out

    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    hook = model.lm_head.register_forward_hook(favour_image)
    try:
        rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
            ids, 2, SamplingParams(max_new_tokens=4, temperature=temperature, seed=0), media=media)
        assert not (rollout.response_ids == image_id).any()
        seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
        attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
        with torch.no_grad():
            scored = model_forward_logprobs(model, seqs, attn, 4, media=row_media(media, rollout.prompt_index))
    finally:
        hook.remove()
    assert (rollout.logprobs < -10).all()  # the full distribution's: the image token kept its mass
    torch.testing.assert_close(scored, rollout.logprobs, atol=1e-4, rtol=0)


def test_idefics3_several_images_padded_per_prompt_score_as_sampled():
    """Idefics3 / SmolVLM take `[prompts, images, 3, H, W]`: prompts with 1, 2 and 0 images are zero-padded to
    one batch (an all-zero image is padding to the model), and the training forward scores what was sampled.
    vLLM's CPU build loads this architecture here (docs/vision.md)."""
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.tiny import tiny_idefics3
    from lmrl.models.vision import freeze_vision, row_media

    model, processor = tiny_idefics3(seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    ids, media = encode_with_media(processor, PROMPTS, IMAGES)
    assert [m["pixel_values"].shape[1] for m in media[:2]] == [1, 2] and media[2] is None
    assert row_media(media, [0, 1, 2, 0])["pixel_values"].shape == (3, 2, 3, 32, 32)  # rows with images, padded
    rollout = HFGenerator(model, processor.tokenizer, eos_token_id=[]).generate(
        ids, 2, SamplingParams(max_new_tokens=5, temperature=1.0, seed=0), media=media)
    for row in range(6):
        expected = forward_logprobs(model, ids[row // 2], media[row // 2], rollout.response_ids[row].tolist(), 5)
        torch.testing.assert_close(rollout.logprobs[row], expected, atol=5e-5, rtol=0)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    with torch.no_grad():
        trained = model_forward_logprobs(model, seqs, attn, 5, media=row_media(media, rollout.prompt_index))
    torch.testing.assert_close(trained, rollout.logprobs, atol=5e-5, rtol=0)
    assert abs((rollout.logprobs - trained).mean().item()) < 1e-5  # sampler vs trainer KL (k1)
    assert freeze_vision(model)[0].startswith("model.vision_model.")


def test_a_jsonl_file_of_image_rows_to_samples_and_scores(tmp_path):
    """From the data file to the forward: rows with one image, two and none (chat parts and a string prompt),
    checked against the processor's image token, rendered, encoded once per prompt, sampled and scored."""
    import json

    from lmrl.data import load_prompts
    from lmrl.data.images import ImageInputs, open_image, row_images
    from lmrl.models.forward import model_forward_logprobs
    from lmrl.models.vision import prompt_text, row_media

    model, processor = tiny_llava(seed=3)
    (tmp_path / "imgs").mkdir()
    for value in (10, 100, 200):
        drawn(value).save(tmp_path / "imgs" / f"{value}.png")
    part = {"type": "image"}
    rows = [
        {"prompt": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}], "image": "imgs/10.png"},
        {"prompt": [{"role": "user", "content": [part, part, {"type": "text", "text": "larger?"}]}],
         "images": ["imgs/100.png", "imgs/200.png"]},
        {"prompt": "no image: 1+1="},
        {"prompt": f"{IMAGE_TOKEN} and {IMAGE_TOKEN}?", "images": ["imgs/10.png"]},  # one short: a bad row, skipped
    ]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_prompts(tmp_path / "train.jsonl", images=ImageInputs(processor.image_token, "tiny-llava"),
                        on_bad_row="skip")
    assert len(data) == 3 and data.skipped[0].where.endswith("train.jsonl line 4")
    texts = [prompt_text(processor, r["prompt"]) for r in data]
    assert texts[0] == f"user: {IMAGE_TOKEN}what is it?\nassistant: " and texts[2] == "no image: 1+1="
    ids, media = encode_with_media(processor, texts, [[open_image(v) for v in row_images(r)] for r in data])
    assert [row.count(model.config.image_token_index) for row in ids] == [16, 32, 0]
    rollout = HFGenerator(model, processor.tokenizer).generate(
        ids, 2, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0), media=media)
    seqs = torch.cat([rollout.prompt_ids, rollout.response_ids], 1)
    attn = torch.cat([rollout.prompt_mask, rollout.response_mask], 1).long()
    with torch.no_grad():
        scored = model_forward_logprobs(model, seqs, attn, seqs.shape[1] - rollout.prompt_ids.shape[1],
                                        media=row_media(media, rollout.prompt_index))
    mask = rollout.response_mask
    torch.testing.assert_close(scored[mask], rollout.logprobs[mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("env", [["env.name=agent", "env.command=python agent.py"], ["env.name=verifiers:my_env"]])
def test_an_agent_program_or_verifiers_environment_is_refused_for_a_vision_policy_before_it_loads(env):
    from lmrl.config.loading import load_config
    from lmrl.errors import ConfigError
    from lmrl.models.vision import refuse_unsupported

    cfg = load_config(None, ["model.name_or_path=tiny-vision", *env])
    with pytest.raises(ConfigError, match=r"^model\.name_or_path=tiny-vision: env\.name: an agent program or a "
                                          r"verifiers environment is not supported with a vision-language policy"):
        refuse_unsupported(cfg)
    refuse_unsupported(load_config(None, ["model.name_or_path=tiny-vision", "env.name=tools", "env.tools=[python]"]))  # lmrl's own: allowed

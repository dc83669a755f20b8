"""Images through the generation server (`lmrl serve`, rollout.backend=vllm-server): a vision-language policy's
prompts go as their ids before the images are expanded plus each image as base64 PNG; the server's generator
processes them (lmrl's decode here: vLLM's CPU build loads Idefics3 only, in minutes) and samples what the trainer
scores with the same images. A real HTTP server (on loopback, in this process: starting `lmrl serve` costs seconds
more) and `lmrl train` through it."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch
from PIL import Image

from lmrl.errors import RunError
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.tiny import tiny_llava
from lmrl.models.vision import encode_with_media, image_prompts, image_to_text, row_media
from lmrl.models.weights import export_weights
from lmrl.rollout import SamplingParams
from lmrl.rollout.remote import ServerGenerator

SECRET = "test-weights-secret"  # a server takes weights only with a weights secret


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A tiny LLaVA saved with its processor, served over HTTP as `lmrl serve rollout.backend=lmrl` serves it (its
    `serving_generator`: lmrl's decode with the model's processor), on loopback in this process."""
    from lmrl.config import load_config
    from lmrl.generators import serving_generator
    from lmrl.rollout.server import GenerationServer, Limits

    path = tmp_path_factory.mktemp("served") / "model"
    model, processor = tiny_llava(seed=2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    serving = serving_generator(load_config(None, [f"model.name_or_path={path}", "rollout.backend=lmrl",
                                                   "model.device=cpu"]))
    server = GenerationServer(serving.generator, serving.tokenizer, str(path), weights_secret=SECRET,
                              limits=Limits(max_prompt_length=64, vocab_size=serving.vocab_size))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield ServerGenerator(server.url, processor.tokenizer, timeout=120, weights_secret=SECRET), model, processor, path
    server.shutdown()
    server.server_close()


def test_a_prompts_images_reach_the_server_and_it_samples_what_the_trainer_scores(served):
    server, model, processor, _ = served
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # the server samples with the weights it is given, not its own
    server.load_weights(export_weights(model), version=1)
    texts = ["<image> what?", "<image><image> which?", "no image"]
    images = [[Image.new("RGB", (32, 32), (200, 30, 30))],
              [Image.new("RGB", (32, 32), (0, 90, 9)), Image.new("RGB", (40, 24), (9, 9, 250))], []]
    ids, bundles = encode_with_media(processor, texts, images)
    rollout = server.generate(ids, 3, SamplingParams(max_new_tokens=6, temperature=1.0, seed=5),
                              images=image_prompts(processor, texts, images))
    assert rollout.prompt_ids.shape[0] == 9 and rollout.response_mask.any()
    with torch.no_grad():
        trained = model_forward_logprobs(model, rollout.sequences, rollout.attention_mask.long(),
                                         rollout.response_ids.shape[1], media=row_media(bundles, rollout.prompt_index))
    assert (rollout.logprobs - trained)[rollout.response_mask].abs().max() < 1e-4


def test_what_the_server_cannot_take_is_one_line(served):
    server, _, processor, _ = served
    ids, _ = encode_with_media(processor, ["<image> x"], [[Image.new("RGB", (32, 32))]])
    body = {"prompts": ids, "n": 1, "params": {"max_new_tokens": 2, "seed": 0}}
    for images, line in [
        ([{"ids": [5], "images": ["not base64!"]}], r"images\[0\]\[0\]: not base64 of an image file"),
        ([{"ids": [5], "images": [image_to_text(Image.new("RGB", (5000, 4000)))]}],
         r"images\[0\]\[0\]: 5000x4000 pixels, more than this server allows \(16777216\)"),
        ([{"ids": [5], "images": [image_to_text(Image.new("RGB", (8, 8)))] * 17}],
         r"images\[0\]: 17 images, more than this server allows \(16\)"),
        ([], r"images: expected a list of 1 objects \{ids, images\}, one per prompt"),
    ]:
        with pytest.raises(RunError, match=r"/lmrl/generate answered 400: " + line):
            server._json("POST", "/lmrl/generate", {**body, "images": images})


def test_a_vision_policy_trains_through_a_generation_server(served, tmp_path, monkeypatch):
    """`rollout.backend=vllm-server` at the server's URL: every step pushes the policy's weights and samples the
    step's image prompts there; the sync check holds the server to the trainer's log-probs with the images."""
    from lmrl.cli import main
    from tests.models.test_vision_train import _dataset

    server, _, _, path = served
    monkeypatch.setenv("LMRL_WEIGHTS_SECRET", SECRET)  # rollout.vllm.server_weights_secret_env's default
    data = _dataset(tmp_path, lambda: tiny_llava(seed=2))
    code = main(["train", f"model.name_or_path={path}", f"data.path={data / 'data.jsonl'}",
                 f"reward.functions=[{data / 'rw.py'}:reward]", "rollout.prompts_per_step=3", "rollout.group_size=4",
                 "rollout.max_new_tokens=6", "train.steps=2", "data.num_eval_prompts=0", "optim.lr=1e-3",
                 "rollout.backend=vllm-server", f"rollout.vllm.server_url={server.url}", "log.console=false",
                 f"train.output_dir={tmp_path / 'run'}"])
    assert code == 0
    steps = [h for h in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) if "loss" in h]
    assert len(steps) == 2 and all(math.isfinite(h["loss"]) for h in steps)
    assert all(h["val/sampler_logprob_diff"] < 1e-4 for h in steps), [h["val/sampler_logprob_diff"] for h in steps]
    assert server.health()["version"] == 1  # the weights of step 2 (one optimizer step done)


def test_a_server_of_a_text_model_refuses_images_in_one_line():
    from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
    from lmrl.rollout.server import GenerationServer, ModelGenerator

    tok = char_tokenizer()
    server = GenerationServer(ModelGenerator(tiny_causal_lm(tok), tok), tok, "text", max_prompt_length=64)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = ServerGenerator(server.url, tok, timeout=60)
        prompts = image_prompts(tiny_llava()[1], ["<image> x"], [[Image.new("RGB", (32, 32))]])
        with pytest.raises(RunError, match=r"/lmrl/generate answered 400: images: this server's model takes no images$"):
            client.generate([[12, 13]], 1, SamplingParams(max_new_tokens=2, seed=0), images=prompts)
    finally:
        server.shutdown()
        server.server_close()


def test_multi_turn_episodes_whose_environment_shows_images_sample_on_the_server(served):
    """Each later turn goes to the server as the episode's ids before its images are expanded, with the prompt's
    image and the observation's: the server's log-probs are the trainer's with the episode's images."""
    from lmrl.rollout.multiturn import generate_episodes
    from tests.rollout.test_multiturn_images import shows

    server, model, processor, _ = served
    server.load_weights(export_weights(model), version=7)
    texts, images = ["<image> what?"], [[Image.new("RGB", (32, 32), (200, 30, 30))]]
    ids, bundles = encode_with_media(processor, texts, images)
    out = generate_episodes(server, processor.tokenizer, ids, [{"token": "<image>"}], 4,
                            SamplingParams(max_new_tokens=3, temperature=1.0, seed=1, stop=list("aeiou st")), shows(),
                            max_turns=2, max_tokens=40, media=bundles, processor=processor,
                            images=image_prompts(processor, texts, images))
    rollout = out.rollout
    assert 2 in out.turns and rollout.media_index is not None  # an episode was shown the second image
    with torch.no_grad():
        trained = model_forward_logprobs(model, rollout.sequences, rollout.attention_mask.long(),
                                         rollout.response_ids.shape[1], media=row_media(rollout.media, rollout.media_rows))
    assert (rollout.logprobs - trained)[rollout.response_mask].abs().max() < 1e-4

"""Multi-turn episodes of a vision-language policy whose environment shows images: the observation's images are
expanded in its tokens (attended, never trained on), the next turn's prefill and the trainer's forward see the
episode's images in order, and the sampler agrees with the trainer."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image

from lmrl.envs import Step
from lmrl.errors import RunError
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.tiny import char_tokenizer, tiny_idefics3, tiny_llava, tiny_qwen2_vl
from lmrl.models.vision import encode_with_media, freeze_vision, image_prompts, image_token, row_media
from lmrl.rollout import HFGenerator, SamplingParams
from lmrl.rollout.multiturn import generate_episodes

GREEN, RED = (0, 200, 40), (200, 30, 30)


def shows(size=(32, 32), colour=GREEN, chat=False):
    """An environment that shows one image after the model's first turn, then ends the episode."""

    class Show:
        def __init__(self, row):
            self.token, self.turn = row["token"], 0

        def step(self, text, token_ids):
            self.turn += 1
            if self.turn > 1:
                return Step(reward=1.0, done=True)
            image = Image.new("RGB", size, colour)
            if chat:
                parts = [{"type": "text", "text": "look:"}, {"type": "image"}]
                return Step(observation=[{"role": "user", "content": parts}], images=[image])
            return Step(observation=f"\nlook: {self.token} now?", images=[image])

    return Show


def episodes(build, env, seed=0):
    model, processor = build()
    token = image_token(processor)
    ids, bundles = encode_with_media(processor, [f"{token} what?", "no image: 1+1="], [[Image.new("RGB", (32, 32), RED)], []])
    # almost every token ends a turn, so that every episode reaches its observation
    generator = HFGenerator(model, processor.tokenizer, eos_token_id=list(range(10, 90)))
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed)
    out = generate_episodes(generator, processor.tokenizer, ids, [{"token": token}] * 2, 3, params, env, max_turns=3,
                            media=bundles, processor=processor)
    return model, processor, out


def trainer_logprobs(model, rollout, media):
    return model_forward_logprobs(model, rollout.sequences, rollout.attention_mask.long(), rollout.response_ids.shape[1],
                                  media=row_media(media, rollout.media_rows))


def images_in(bundle) -> int:
    if "image_grid_thw" in bundle:  # Qwen2-VL: one grid per image
        return int(bundle["image_grid_thw"].shape[0])
    pixels = bundle["pixel_values"]
    return int(pixels.shape[1] if pixels.dim() == 5 else pixels.shape[0])  # Idefics3: [1, images, 3, H, W]


@pytest.mark.parametrize("build, size", [(tiny_llava, (32, 32)), (tiny_qwen2_vl, (64, 32)), (tiny_idefics3, (32, 32))])
def test_an_image_an_environment_shows_is_seen_by_the_next_turn_and_the_trainer(build, size):
    model, processor, out = episodes(build, shows(size))
    rollout = out.rollout
    assert out.turns == [2] * 6 and rollout.media_index.tolist() == list(range(6))  # one bundle per episode
    assert [images_in(m) for m in rollout.media] == [2, 2, 2, 1, 1, 1]  # the prompt's image, then the observation's; the text prompt's: its own
    image_id = model.config.image_token_id if hasattr(model.config, "image_token_id") else model.config.image_token_index
    shown = rollout.response_ids == image_id
    assert shown.any() and not (shown & rollout.response_mask).any()  # attended, never trained on
    assert rollout.attention_mask[:, -rollout.response_ids.shape[1]:][shown].all()
    with torch.no_grad():
        trained = trainer_logprobs(model, rollout, rollout.media)
    assert (rollout.logprobs - trained)[rollout.response_mask].abs().max() < 1e-4
    # the second turns depend on the observation's image: another one scores them differently
    _, _, other = episodes(build, shows(size, colour=(0, 0, 250)))
    second = rollout.response_mask & shown.cumsum(1).bool()
    with torch.no_grad():
        swapped = trainer_logprobs(model, rollout, other.rollout.media)
    assert (swapped - trained)[second].abs().max() > 1e-4
    # gradients: finite in the language model, none in the frozen tower
    frozen = set(freeze_vision(model))
    model.train()
    loss = -(trainer_logprobs(model, rollout, rollout.media) * rollout.response_mask).sum()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert frozen and all(grads[n] is None for n in frozen)
    assert all(torch.isfinite(g).all() for n, g in grads.items() if g is not None)
    assert any(g is not None and g.abs().sum() > 0 for n, g in grads.items() if "embed_tokens" in n)


def test_a_chat_observation_with_an_image_part_and_episodes_that_show_none():
    _, processor, out = episodes(tiny_llava, shows(chat=True))
    assert "look:" in out.rollout.texts[0] and all(m["pixel_values"].shape[0] >= 1 for m in out.rollout.media)

    class Quiet:  # shows no image: the rollout keeps one bundle per prompt, as a single-turn one
        def __init__(self, row):
            self.turn = 0

        def step(self, text, token_ids):
            self.turn += 1
            return Step(observation="\nagain:", done=self.turn > 1)

    _, _, quiet = episodes(tiny_llava, Quiet)
    assert quiet.rollout.media_index is None and len(quiet.rollout.media) == 2 and quiet.rollout.media[1] is None


def test_what_cannot_be_shown_is_refused_in_one_line():
    from tests.rollout.test_hf_generator import scrambled_model

    tok = char_tokenizer()
    text_model = HFGenerator(scrambled_model(tok, "llama", seed=3), tok, eos_token_id=list(range(10, 90)))
    params = SamplingParams(max_new_tokens=2, temperature=1.0, seed=0)
    with pytest.raises(RunError, match=r"^env: a step returned 1 image\(s\) but the policy is a text-only model"):
        generate_episodes(text_model, tok, [[12, 13]], [{"token": "<image>"}], 1, params, shows(), max_turns=2)

    class Unmarked(shows()):  # an image without its placeholder
        def step(self, text, token_ids):
            return Step(observation="look", images=[Image.new("RGB", (32, 32))])

    with pytest.raises(RunError, match=r"^env: a step's observation holds 0 image placeholder\(s\) \(<image>\) for 1"):
        episodes(tiny_llava, Unmarked)


def test_rows_keep_their_episodes_images_when_kept_and_joined():
    """Dynamic sampling keeps some groups (`select_rollout`) and joins rounds (`concat_rollouts`): every row still
    scores with its own episode's images, beside a round whose rows share their prompt's."""
    from lmrl.rollout import concat_rollouts, select_rollout

    model, processor, shown = episodes(tiny_llava, shows())
    _, _, plain = episodes(tiny_llava, lambda row: type("Done", (), {"step": lambda self, t, i: Step(done=True)})())
    assert plain.rollout.media_index is None
    kept = select_rollout(shown.rollout, torch.tensor([3, 4, 5]))
    joined = concat_rollouts([kept, plain.rollout], processor.tokenizer.pad_token_id)
    assert joined.media_index is not None and len(joined.media_index) == 9
    with torch.no_grad():
        scored = trainer_logprobs(model, joined, joined.media)
    assert (joined.logprobs - scored)[joined.response_mask].abs().max() < 1e-4


def test_an_environment_that_runs_its_own_episodes_is_refused_with_a_vision_policy():
    class Agent:  # drives its episodes itself (`lmrl.agents.programs`): it would not see the images
        def run_episodes(self, *args):
            raise AssertionError("not reached")

    with pytest.raises(RunError, match=r"^env: an environment that runs its own episodes \(run_episodes\) is not "
                                       r"supported with a vision-language policy$"):
        episodes(tiny_llava, Agent())


class ExpandingEngine:
    """Samples as vLLM does with images: given each prompt's ids before the images are expanded and its images, it
    expands every image token itself (checking that this gives the ids the trainer scores) and samples with them."""

    processes_images = True

    def __init__(self, model, processor):
        self.inner, self.processor = HFGenerator(model, processor.tokenizer, eos_token_id=list(range(10, 90))), processor
        self.image_id = processor.tokenizer.convert_tokens_to_ids(image_token(processor))
        self.pad_token_id, self.seen = self.inner.pad_token_id, []

    def generate(self, prompts, n, params, images):
        from lmrl.models.vision import image_media

        for expanded, prompt in zip(prompts, images):
            pictures, ids = iter(prompt.images), []
            for t in prompt.ids:
                ids += self._expansion(next(pictures)) if t == self.image_id else [t]
            assert ids == expanded and next(pictures, None) is None
            self.seen.append(len(prompt.images))
        return self.inner.generate(prompts, n, params, media=[image_media(self.processor, p.images) for p in images])

    def _expansion(self, image):
        return self.processor(text=[image_token(self.processor)], images=[image], add_special_tokens=False,
                              return_tensors="pt")["input_ids"][0].tolist()


def test_an_engine_that_expands_images_itself_gets_each_episodes_ids_and_images():
    """vLLM (or a generation server) takes ids before the images are expanded: every later turn gets its episode's,
    the prompt's then each turn's and each observation's, with the prompt's images then the observation's."""
    model, processor = tiny_llava()
    texts, images = ["<image> what?", "no image: 1+1="], [[Image.new("RGB", (32, 32), RED)], []]
    ids, bundles = encode_with_media(processor, texts, images)
    engine = ExpandingEngine(model, processor)
    out = generate_episodes(engine, processor.tokenizer, ids, [{"token": "<image>"}] * 2, 2,
                            SamplingParams(max_new_tokens=4, temperature=1.0, seed=0), shows(), max_turns=3,
                            media=bundles, processor=processor, images=image_prompts(processor, texts, images))
    assert out.turns == [2] * 4 and engine.seen == [1, 0, 2, 2, 1, 1]  # turn 1: the prompts'; turn 2: each episode's
    rollout = out.rollout
    with torch.no_grad():
        trained = trainer_logprobs(model, rollout, rollout.media)
    assert (rollout.logprobs - trained)[rollout.response_mask].abs().max() < 1e-4


@pytest.mark.parametrize("build, tower_name", [(tiny_llava, "vision_tower"), (tiny_qwen2_vl, "visual")])
def test_a_vision_policy_trains_on_episodes_that_show_images(tmp_path, build, tower_name):
    """generate -> experience -> update from Python (`Trainer(model=, tokenizer=processor, env=)`): a prompt's image,
    then an observation's (of another size for Qwen2-VL, its 3-D positions over whole episodes). `lmrl train
    env.name=file.py:Class` in a subprocess runs the same with a vLLM engine and asynchronously
    (tests/models/test_vision_train.py) and with tiny-vision (docs/agents.md's example, run by tests/docs)."""
    from lmrl import Trainer
    from lmrl.config import load_config

    model, processor = build(seed=1)
    tower = {k: v.clone() for k, v in model.state_dict().items() if tower_name in k}
    language = {k: v.clone() for k, v in model.state_dict().items() if "language_model" in k}
    token = image_token(processor)
    rows = [{"prompt": f"{token} what {i}?", "image": Image.new("RGB", (32, 32), (30 * i, 90, 9)), "token": token}
            for i in range(4)]
    cfg = load_config(None, ["train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "optim.lr=1e-3",
                             "rollout.max_new_tokens=3", "rollout.stop=[a,e,i,o,u,' ',s,t,n,r,l,d,h]", "env.max_turns=2",
                             "env.max_tokens=40", "data.num_eval_prompts=0", "algorithm.tis_cap=2.0", "log.console=false",
                             "log.samples_every=1", "log.num_samples=8",
                             f"train.output_dir={tmp_path}"])
    reward = lambda completions, **kw: [sum(map(ord, c)) % 7 / 7 for c in completions]  # noqa: E731
    trainer = Trainer(cfg, model=model, tokenizer=processor, reward_funcs=[reward], train_dataset=rows,
                      env=shows((64, 32) if build is tiny_qwen2_vl else (32, 32)))
    history = trainer.train().history
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    assert all(h["env/observation_tokens"] > 0 for h in history)  # episodes were shown the environment's image
    assert all(abs(h["val/sampler_kl"]) < 1e-4 and h["val/sampler_logprob_diff"] < 1e-4 for h in history)
    assert tower and all(torch.equal(v, model.state_dict()[k].cpu()) for k, v in tower.items())  # frozen
    assert any(not torch.equal(v, model.state_dict()[k].cpu()) for k, v in language.items())  # trained
    # samples.jsonl names what each sample saw: its prompt's image, then the environment's, kept for the report
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    seen = [s["images"] for s in samples]
    assert seen and {len(x) for x in seen} <= {1, 2} and any(len(x) == 2 for x in seen), seen
    shown = {x[1] for x in seen if len(x) == 2}
    assert len(shown) == 1 and (tmp_path / "images" / (shown.pop().removeprefix("sha256:") + ".png")).exists()

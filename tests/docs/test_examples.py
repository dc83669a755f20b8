"""Every page's examples run as a reader would run them (`tests/docs/examples.py` says how), and the
machinery itself fails where a page goes stale: shown here by breaking each kind of example on purpose."""

from __future__ import annotations

import pytest

from tests.docs import examples
from tests.docs.examples import ROOT, DocError

PAGES = examples.pages()


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_the_pages_examples_do_what_the_page_says(page, tmp_path):
    examples.run_page(page, tmp_path)


def test_every_block_is_run_or_named_with_its_reason():
    blocks = [b for p in PAGES for b in examples.parse(p).blocks]
    skipped = examples.skipped_blocks()
    assert len(skipped) <= 10, skipped  # the few that need a GPU, the network, minutes, a server or nodes
    run = [b for b in blocks if b.language != "text" and not b.skip]
    assert len(run) >= 40


def test_a_plain_lmrl_command_is_forked_and_a_shell_one_runs_in_bash(tmp_path):
    """A plain `lmrl ...` runs forked from the suite's zygote (a CompletedProcess named by the command); shell
    syntax outside quotes (a pipe, a variable, a glob) goes to bash. Inside quotes it is an argument's text:
    `'model.lora={r: 16}'` is forked all the same, and gets the same argument bash would have passed."""
    forked = ["lmrl --version", "lmrl train 'model.lora={r: 16, alpha: 32}' train.steps=3 --dry-run",
              'lmrl train "reward.functions=[{fn: exact_match, column: solution}]" --dry-run']
    shelled = ["lmrl --version | cat", "lmrl --ver$NOTHING'sion'", 'lmrl "--ver$NOTHING"sion']  # bash: lmrl --version
    for command in forked:
        done = examples.shell(command, tmp_path)
        assert done.args == command and done.returncode == 0, (command, done.stderr[-500:])
    for command in shelled:
        done = examples.shell(command, tmp_path)
        assert done.args == ["bash", "-c", command] and done.returncode == 0, (command, done.stderr[-500:])
    said = examples.shell(forked[1], tmp_path).stdout
    assert "lora={'r': 16, 'alpha': 32.0" in said, said[-500:]


# ------------------------------------------------------------------------------ broken on purpose
def _page(tmp_path, text: str):
    page = ROOT / "docs" / f".broken-{tmp_path.name}.md"  # a page of the docs while the test runs
    page.write_text(examples.dedent(text))
    return page


@pytest.fixture
def broken(tmp_path):
    made = []

    def write(text: str):
        made.append(_page(tmp_path, text))
        return made[-1]

    yield write
    for page in made:
        page.unlink()


BROKEN = {
    "a command that no longer works": ("```bash\nlmrl train train.stesp=3\n```\n", r":2: `lmrl train train.stesp=3` exited 2"),
    "a config key that does not exist": ("```yaml\ntrain:\n  stesp: 3\n```\n", r":1: train.stesp: train has no field"),
    "an error line that lmrl does not print": (
        "```console\n$ lmrl train rollout.group_size=1\nlmrl: error: rollout.group_size: must be >= 3\n```\n",
        r":2: `lmrl train rollout.group_size=1` did not print 'lmrl: error: rollout.group_size: must be >= 3'"),
    "a python example that raises": ("```python\nfrom lmrl import Config\nConfig(train={'steps': 0})\n```\n",
                                     r":1: the python block failed:\n[\s\S]*train.steps: must be >= 1"),
    "a block without a language": ("```\nlmrl train\n```\n", r":1: a fenced block needs a language"),
    "a skip without a known reason": ("<!-- docs: skip slow -->\n```bash\nlmrl train\n```\n",
                                      r":2: 'docs: skip slow': the reason is one of"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_page_broken_on_purpose_fails_naming_its_line(case, broken, tmp_path):
    text, message = BROKEN[case]
    page = broken(text)
    with pytest.raises(DocError, match=rf"^docs/\.broken-.*\.md{message}"):
        examples.run_page(page, tmp_path)


def test_the_same_examples_fixed_pass(broken, tmp_path):
    page = broken("""
        ```bash
        lmrl train train.steps=3 train.output_dir=out   # runs 2 steps here
        ```

        ```yaml
        train:
          steps: 3
        ```

        ```console
        $ lmrl train rollout.group_size=1
        lmrl: error: rollout.group_size: must be >= 2 for the grpo advantage (got 1)
        ```

        ```python
        from lmrl import Config
        Config(train={'steps': 1})
        ```
        """)
    counts = examples.run_page(page, tmp_path)
    assert counts == {"bash": 1, "yaml": 1, "console": 1, "python": 1}
    assert [r["step"] for r in map(__import__("json").loads, (tmp_path / "out" / "metrics.jsonl").read_text().splitlines())][-1] == 2

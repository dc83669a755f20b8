"""The fields a resumed run may change, as docs/long-runs.md lists them (its paragraph and its quoted line), are
the ones lmrl allows (`lmrl.checkpoint.RESUMABLE_CHANGES`): the list went stale twice before this test."""

from __future__ import annotations

import re

from lmrl.checkpoint import RESUMABLE_CHANGES
from tests.docs.examples import ROOT


def test_the_pages_list_of_resumable_fields_is_lmrls():
    page = (ROOT / "docs" / "long-runs.md").read_text()
    allowed = {k + "*" if k.endswith(".") else k for k in RESUMABLE_CHANGES}
    paragraph = page.split("Only fields that cannot change what the saved state means may differ on resume:")[1]
    paragraph = paragraph.split(". Anything else")[0]
    assert set(re.findall(r"`([\w.*]+)`", paragraph)) == allowed
    quoted = re.search(r"only (train\.steps, .*?) may change on resume", page).group(1)
    assert quoted.split(", ") == [k + "*" if k.endswith(".") else k for k in RESUMABLE_CHANGES]

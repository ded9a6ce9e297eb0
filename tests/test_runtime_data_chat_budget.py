"""A chat template is code that arrives with a downloaded folder: every render runs under a budget (loop steps and
calls, characters, seconds), and a template that would hang, exhaust memory or overflow is refused in one sentence
naming the folder, quickly and in bounded memory, while real templates render exactly as before."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _chat_fixtures import chat_folder

from trainscale.errors import TrainscaleError
from trainscale.runtime.data.chat import MAX_RENDER_STEPS, encode_example, encode_prompt, load_chat_tokenizer

EXAMPLE = {"prompt": "What is the capital of France?", "response": "Paris."}

# Each of these would hang, abort the process or end in an "unexpected" line without the budget.
HOSTILE = {
    "nested loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x",
    "a range past the sandbox's": "{% for i in range(10**9) %}{{ i }}{% endfor %}",
    "loops over the messages, nested": "{% for a in messages * 5000 %}{% for b in messages * 5000 %}{% endfor %}"
                                      "{% endfor %}",
    "a huge repeated string": "{{ 'a' * 10**10 }}",
    "a huge repeated list": "{{ ([1] * 10**6) * 10**6 }}",
    "a string doubled by ~": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                             "{% endfor %}{{ ns.s | length }}",
    "a string doubled by +": "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
                             "{% endfor %}{{ ns.s | length }}",
    "a number squared in a loop": "{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                                  "{% endfor %}{{ ns.n > 0 }}",
    "a tower of powers": "{{ 10 ** 10 ** 10 }}",
    "a recursive macro that fans out": "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                                       "{% endmacro %}{{ f(60) }}",
    "a centred field": "{{ 'x' | center(10**10) }}",
    "a padded method": "{{ 'x'.ljust(99999999999) }}",
    "a wide format field": "{{ '{:>9999999999}'.format(1) }}",
    "a wide percent field": "{{ '%9999999999s' % 'x' }}",
    "a replace that multiplies": "{{ ('a' * 1000000) | replace('', 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb') "
                                 "| length }}",
    "a join of many copies": "{{ ('a' * 1000000).join(['x'] * 100000) | length }}",
    "many outputs": "{% for i in range(99999) %}{{ 'y' * 999999 }}{% endfor %}",
}


def _hostile_folder(tmp_path: Path, name: str, template: str) -> Path:
    folder = chat_folder(tmp_path / name.replace(" ", "-"), "llama3")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_template_is_one_sentence_quickly(tmp_path, name):
    folder = _hostile_folder(tmp_path, name, HOSTILE[name])
    t0 = time.perf_counter()
    with pytest.raises(TrainscaleError) as e:
        encode_example(EXAMPLE, load_chat_tokenizer(folder), where="chat data file x line 1")
    assert time.perf_counter() - t0 < 20
    message = str(e.value)
    assert "\n" not in message and str(folder) in message, message
    assert "chat template" in message


def test_the_same_budget_holds_for_a_prompt_and_its_steps_are_counted(tmp_path):
    folder = _hostile_folder(tmp_path, "steps", HOSTILE["nested loops"])
    with pytest.raises(TrainscaleError, match=f"more than {MAX_RENDER_STEPS:,} loop steps and calls"):
        encode_prompt(load_chat_tokenizer(folder), [{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_a_hostile_template_stays_in_bounded_memory(tmp_path):
    """In a process capped at 3 GiB of address space, every hostile template above is refused (no abort)."""
    folders = {name: str(_hostile_folder(tmp_path, name, t)) for name, t in HOSTILE.items()}
    code = f"""
import json, resource, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from trainscale.runtime.data.chat import encode_example, load_chat_tokenizer
from trainscale.errors import TrainscaleError
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
out = {{}}
for name, folder in json.loads(sys.argv[1]).items():
    try:
        encode_example({EXAMPLE!r}, load_chat_tokenizer(folder))
        out[name] = "rendered"
    except TrainscaleError:
        out[name] = "refused"
print(json.dumps(out))
"""
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(folders)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == {name: "refused" for name in HOSTILE}


def test_real_templates_render_within_the_budget(tmp_path):
    """The fixtures' Llama 3 and ChatML templates over a long conversation: rendered whole, nothing refused."""
    turns = [{"role": r, "content": f"message {i} " * 50} for i, r in
             enumerate(["user", "assistant"] * 500)]
    for family in ("llama3", "chatml"):
        tok = load_chat_tokenizer(chat_folder(tmp_path / family, family))
        text = tok.render(turns)
        assert all(m["content"].strip() in text for m in turns)

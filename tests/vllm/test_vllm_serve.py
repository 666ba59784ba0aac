"""``vllm serve`` pools behind ``kvstore vllm-router`` (issue 20): OpenAI API servers of vLLM
with kvstore's connector as the prefill (kv_producer) and decode (kv_consumer) pools,
a plain ``vllm serve`` beside them, and the ``openai`` client. The router's answers
must be token for token the plain server's; the decode server must have loaded the
prompt's blocks from the store; a prompt the store holds whole skips the prefill.
Runs in .venv-vllm (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.support.server_process import ALPHA  # noqa: E402
from tests.support.vllm_fixtures import BLOCK, write_tiny_llama, write_tiny_lora  # noqa: E402
from tests.support.vllm_serve import free_port, serve_stack, vllm_router  # noqa: E402

pytestmark = pytest.mark.process

CHAT_TEMPLATE = (
    "{% for m in messages %}t5 {{ m['content'] }} t6 {% endfor %}"
    "{% if add_generation_prompt %}t7{% endif %}"
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("vllm-serve")
    model = write_tiny_llama(root / "tiny")
    # a chat template in the tiny tokenizer's words ("t<id>", split at spaces)
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    adapter = write_tiny_lora(root / "sql-lora", model)
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"sql={adapter}"]
    runtime_lora = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}  # /v1/load_lora_adapter
    with serve_stack(root, model, "float32", lora, runtime_lora) as s:
        yield {**s, "root": root}


def _hits(c: Any) -> int:
    """Blocks the store served (every tier, every tenant)."""
    return sum(v for k, v in c.stats()["server"].items() if k.startswith("hits_"))


def _prompt(seed: int, n: int) -> list[int]:
    """Token ids (a completion's prompt may be ids): the blocks are then exactly known."""
    import random

    rnd = random.Random(seed)
    return [rnd.randrange(4, 500) for _ in range(n)]


def test_the_router_answers_as_a_plain_vllm_server(stack: dict[str, Any]) -> None:
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    prompt = _prompt(1, 3 * BLOCK + 5)  # three full blocks and a tail
    args = dict(model=stack["model"], prompt=prompt, max_tokens=12, temperature=0.0)
    want = plain.completions.create(**args).choices[0].text
    with stack["store"].client(ALPHA) as c:
        hits_before = _hits(c)
        raw = via.completions.with_raw_response.create(**args)
        got = raw.parse().choices[0].text
        assert got == want
        assert raw.headers["x-kvstore-prefill"] == stack["prefill"].url
        assert raw.headers["x-kvstore-cached-blocks"] == "0/3"
        assert raw.headers["x-kvstore-decode"] == stack["decode"].url
        # the decode server read the prompt's blocks from the store
        assert _hits(c) >= hits_before + 3

    # the same prompt again: the store holds every full block, no prefill
    again = via.completions.with_raw_response.create(**args)
    assert again.headers["x-kvstore-prefill"] == "skipped"
    assert again.headers["x-kvstore-cached-blocks"] == "3/3"
    assert again.parse().choices[0].text == want


def test_a_streamed_answer_through_the_router_is_the_plain_one(stack: dict[str, Any]) -> None:
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    prompt = _prompt(2, 2 * BLOCK + 9)
    args = dict(model=stack["model"], prompt=prompt, max_tokens=10, temperature=0.0)
    want = plain.completions.create(**args).choices[0].text
    got = "".join(
        ch.choices[0].text for ch in via.completions.create(stream=True, **args) if ch.choices
    )
    assert got == want


def test_a_chat_through_the_router_is_the_plain_one_and_its_prefix_is_found(
    stack: dict[str, Any],
) -> None:
    """The router applies the model's chat template as vLLM does: the answer is the
    plain server's, and asked again the store holds every block of the prompt."""
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    words = " ".join(f"t{t}" for t in _prompt(3, 2 * BLOCK + 7))
    args = dict(
        model=stack["model"],
        messages=[{"role": "user", "content": words}],
        max_tokens=8,
        temperature=0.0,
    )
    answer = plain.chat.completions.create(**args)
    want = answer.choices[0].message.content
    assert answer.usage is not None
    full = answer.usage.prompt_tokens // BLOCK  # vLLM's own count of the prompt
    assert full >= 2
    first = via.chat.completions.with_raw_response.create(**args)
    assert first.parse().choices[0].message.content == want
    assert first.headers["x-kvstore-cached-blocks"] == f"0/{full}"  # the router's count
    again = via.chat.completions.with_raw_response.create(**args)
    assert again.headers["x-kvstore-prefill"] == "skipped"
    assert again.headers["x-kvstore-cached-blocks"] == f"{full}/{full}"
    assert again.parse().choices[0].message.content == want


def test_a_salted_prompt_shares_blocks_only_within_its_salt(stack: dict[str, Any]) -> None:
    """vLLM's cache_salt: the connector roots a salted request's keys in its salt, and
    the router checks the store with the same keys. A prompt stored unsalted is a miss
    under a salt (the prefill runs); stored under that salt, it is a hit under it."""
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    args = dict(model=stack["model"], prompt=_prompt(6, 3 * BLOCK + 4), max_tokens=6,
                temperature=0.0)  # fmt: skip
    want = plain.completions.create(**args).choices[0].text
    assert via.completions.create(**args).choices[0].text == want  # stored unsalted
    salted: dict[str, Any] = {**args, "extra_body": {"cache_salt": "tenant-a"}}
    first = via.completions.with_raw_response.create(**salted)
    assert first.headers["x-kvstore-cached-blocks"] == "0/3"
    assert first.headers["x-kvstore-prefill"] == stack["prefill"].url
    assert first.parse().choices[0].text == want
    again = via.completions.with_raw_response.create(**salted)
    assert again.headers["x-kvstore-cached-blocks"] == "3/3"
    assert again.parse().choices[0].text == want


def test_a_lora_prompt_shares_blocks_only_under_its_adapter(stack: dict[str, Any]) -> None:
    """A LoRA adapter's KV is not the base model's: the connector roots an adapter's
    chain in its name and path, and the router, which learns both from the servers'
    ``/v1/models``, checks with the same keys. A prompt stored for the base model is a
    miss under the adapter (the prefill runs); once stored under it, a hit, and the
    decode server's answer from those blocks is the plain server's."""
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    base = dict(model=stack["model"], prompt=_prompt(7, 3 * BLOCK + 4), max_tokens=6,
                temperature=0.0)  # fmt: skip
    tuned = {**base, "model": "sql"}
    want, want_base = (plain.completions.create(**a).choices[0].text for a in (tuned, base))
    assert want != want_base  # the adapter changes the answer: its KV differs
    assert via.completions.create(**base).choices[0].text == want_base  # stored as base
    first = via.completions.with_raw_response.create(**tuned)
    assert first.headers["x-kvstore-cached-blocks"] == "0/3"
    assert first.headers["x-kvstore-prefill"] == stack["prefill"].url
    assert first.parse().choices[0].text == want
    again = via.completions.with_raw_response.create(**tuned)
    assert again.headers["x-kvstore-cached-blocks"] == "3/3"
    assert again.headers["x-kvstore-prefill"] == "skipped"
    assert again.parse().choices[0].text == want


def test_an_adapter_loaded_at_run_time_is_checked_under_its_own_chain(
    stack: dict[str, Any],
) -> None:
    """An adapter loaded into the running servers (vLLM's ``/v1/load_lora_adapter``) is
    not in the router's list until it reads the servers' list again (once that is
    REFRESH_S old, at a request naming an adapter); from then its prompts are checked
    under that adapter's chain: a prompt stored under another adapter is a miss."""
    from engine.serving.vllm_adapters import REFRESH_S
    from tests.support.vllm_fixtures import write_tiny_lora

    path = write_tiny_lora(stack["root"] / "chat-lora", stack["model"], seed=6)
    for s in (stack["plain"], stack["prefill"], stack["decode"]):
        r = httpx.post(s.url + "/v1/load_lora_adapter",
                       json={"lora_name": "chat", "lora_path": str(path)}, timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
    via = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="unused")
    plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
    args = dict(model="chat", prompt=_prompt(8, 3 * BLOCK + 4), max_tokens=6,
                temperature=0.0)  # fmt: skip
    want = plain.completions.create(**args).choices[0].text
    sql = plain.completions.create(**{**args, "model": "sql"}).choices[0].text
    assert via.completions.create(**{**args, "model": "sql"}).choices[0].text == sql
    time.sleep(REFRESH_S + 0.1)  # the router reads the list again once it is this old
    first = via.completions.with_raw_response.create(**args)  # stored under sql only
    assert first.headers["x-kvstore-cached-blocks"] == "0/3"
    assert first.parse().choices[0].text == want != sql
    again = via.completions.with_raw_response.create(**args)
    assert again.headers["x-kvstore-cached-blocks"] == "3/3"
    assert again.parse().choices[0].text == want


def _router_over(stack: dict[str, Any], decode: list[str], name: str) -> Any:
    """Another router over the stack's prefill server and these decode servers."""
    return vllm_router(
        stack["root"], stack["model"], "float32", stack["store"], [stack["prefill"].url],
        decode, name=name,
    )  # fmt: skip


def test_a_decode_server_that_cannot_be_reached_is_passed_over(stack: dict[str, Any]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with _router_over(stack, [dead, stack["decode"].url], "router-failover") as url:
        via = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        plain = openai.OpenAI(base_url=stack["plain"].url + "/v1", api_key="unused")
        args = dict(
            model=stack["model"], prompt=_prompt(4, BLOCK + 3), max_tokens=6, temperature=0.0
        )
        raw = via.completions.with_raw_response.create(**args)
        assert raw.headers["x-kvstore-decode"] == stack["decode"].url
        assert raw.parse().choices[0].text == plain.completions.create(**args).choices[0].text


# -- last: it kills the stack's decode server ----------------------------------------------


def test_a_stream_whose_decode_server_dies_goes_on_on_another(stack: dict[str, Any]) -> None:
    """SIGKILL of the decode server (its API server and engine) while it streams: the
    router asks the rest of the plain server as a completion of the prompt's and the
    answer's token ids so far, and the client's stream goes on to its end: the tokens
    before the kill are the plain server's own, none is lost or repeated, and the rest
    is the plain server's answer too, up to float rounding: the moved stream may part
    from it only where the plain server's two best tokens were a near tie (the rest
    recomputes the answer's tail in one pass, which rounds unlike decoding)."""
    decode, plain = stack["decode"], stack["plain"]
    with _router_over(stack, [decode.url, plain.url], "router-resume") as url:
        via = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        direct = openai.OpenAI(base_url=plain.url + "/v1", api_key="unused")
        prompt = _prompt(5, 2 * BLOCK + 3)
        args: dict[str, Any] = dict(model=stack["model"], prompt=prompt, temperature=0.0)
        start = time.monotonic()
        direct.completions.create(max_tokens=64, extra_body={"ignore_eos": True}, **args)
        per_token_s = (time.monotonic() - start) / 64
        n = int(min(3000, max(256, 5.0 / per_token_s)))  # ~5 s of this machine's decoding
        ids = {"ignore_eos": True, "return_token_ids": True}
        want = direct.completions.create(max_tokens=n, logprobs=2, extra_body=ids, **args)
        stream = via.completions.with_raw_response.create(
            max_tokens=n, stream=True, stream_options={"include_usage": True},
            extra_body=ids, **args,
        )  # fmt: skip
        assert stream.headers["x-kvstore-decode"] == decode.url
        before, after, finish, usage = "", "", None, None
        got: list[list[int]] = [[], []]  # token ids before the kill, after it
        for ch in stream.parse():
            if ch.usage is not None:
                usage = ch.usage
            for c in ch.choices:
                dead = decode.proc.poll() is not None
                if dead:
                    after += c.text
                else:
                    before += c.text
                got[dead] += (c.model_extra or {}).get("token_ids") or []
                finish = c.finish_reason or finish
            if before and decode.proc.poll() is None:
                for pid in decode.pids():
                    os.kill(pid, signal.SIGKILL)
                decode.proc.wait(30)
        assert after and finish == "length"
        assert usage is not None and usage.completion_tokens == n
        assert usage.prompt_tokens == len(prompt)
        plain_answer = want.choices[0]
        assert plain_answer.text.startswith(before)  # what the dead server sent was its own
        assert len(got[0]) + len(got[1]) == n
        parted = _parting(got[0] + got[1], plain_answer)
        assert parted is None or parted[0] >= len(got[0])
        assert parted is None or parted[1] < 1e-2, f"parted from the plain answer at {parted}"
        assert httpx.get(url + "/health", timeout=10).json()["stream_resumes"] == 1


def _parting(ids: list[int], plain: Any) -> tuple[int, float] | None:
    """Where ``ids`` first differ from the plain server's answer ``plain`` (a choice
    asked with ``logprobs=2`` and its token ids), and the gap there between the plain
    server's two best log-probabilities; None when they never differ."""
    want = (plain.model_extra or {})["token_ids"]
    i = next((i for i, (a, b) in enumerate(zip(ids, want, strict=True)) if a != b), None)
    if i is None:
        return None
    best = sorted(plain.logprobs.top_logprobs[i].values(), reverse=True)
    return i, best[0] - best[1]

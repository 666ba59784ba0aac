"""The serving path end to end, on real processes: etcd, two store nodes, two prefill
workers and a decode worker (tiny model), routers with different policies, and the
`openai` client (a client nobody here wrote) talking to them over loopback HTTP."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.serving.conftest import chat_ids, plain_engine, plain_greedy, plain_ids, words
from tests.serving.procs import ServingCluster
from tests.support.etcd_fixtures import EtcdProcess

pytest_plugins = ["tests.support.etcd_fixtures"]
pytestmark = [pytest.mark.process, pytest.mark.slow]
N = 12


@pytest.fixture(scope="module")
def cluster(
    etcd_server: EtcdProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServingCluster]:
    c = ServingCluster(tmp_path_factory.mktemp("serving"), etcd_server.endpoint, "router-tests")
    try:
        c.add_node("n0")
        c.add_node("n1")
        c.add_workers([
            {"id": "p0", "role": "prefill", "node": "n0", "flags": ["--layer-parts", "2"]},
            {"id": "p1", "role": "prefill", "node": "n1"},
            {"id": "d0", "role": "decode", "node": "n0", "flags": ["--save-decode"]},
        ])  # fmt: skip
        c.urls = {"cache_aware": c.add_router()}  # type: ignore[attr-defined]
        yield c
    finally:
        c.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _conversation(seed: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": words(400, seed)},
        {"role": "user", "content": "Why would a long conversation start faster?"},
    ]


def test_openai_client_streams_the_plain_engines_tokens(cluster: ServingCluster) -> None:
    msgs = _conversation(1)
    client = _client(cluster.urls["cache_aware"])  # type: ignore[attr-defined]
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=msgs, max_tokens=N, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert raw.headers["x-kvstore-prefill-worker"] in ("p0", "p1")
    assert raw.headers["x-kvstore-decode-worker"] == "d0"
    text, usage, finish = "", None, None
    for ch in raw.parse():
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage is not None:
            usage = ch.usage
    assert text == plain_engine(chat_ids(msgs), N)
    assert finish in ("stop", "length")
    assert usage is not None and usage.prompt_tokens == len(chat_ids(msgs))
    kv = usage.model_extra["kvstore"]
    assert kv["prefill_worker"] in ("p0", "p1") and kv["decode_worker"] == "d0"
    assert kv["short_prompt"] is False


def test_a_long_new_message_is_tokenized_by_the_worker_and_filed_for_the_next_turn(
    cluster: ServingCluster,
) -> None:
    """The router tokenizes a long new message only up to the first block no node holds;
    the prefill worker tokenizes the rest. The answer and the counted prompt tokens are
    exact, and the next turn finds the message in the router's piece cache."""
    url = cluster.urls["cache_aware"]  # type: ignore[attr-defined]
    client = _client(url)

    def worker_tokenized() -> float:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("kvstore_router_worker_tokenized_total "):
                return float(line.split()[1])
        raise AssertionError("no kvstore_router_worker_tokenized_total")

    msgs = [{"role": "user", "content": words(700, 31)}]  # ~4,900 characters, new
    before = worker_tokenized()
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N)
    assert worker_tokenized() == before + 1
    assert r1.choices[0].message.content == plain_engine(chat_ids(msgs), N)
    assert r1.usage is not None and r1.usage.prompt_tokens == len(chat_ids(msgs))
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content or ""},
        {"role": "user", "content": "Short follow-up?"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N)
    assert worker_tokenized() == before + 1  # every piece was cached or short
    assert r2.choices[0].message.content == plain_engine(chat_ids(msgs), N)
    assert r2.usage is not None and r2.usage.prompt_tokens == len(chat_ids(msgs))
    assert r2.usage.model_extra["kvstore"]["cached_tokens"] > 0


def test_completions_not_streamed_match_too(cluster: ServingCluster) -> None:
    prompt = words(300, 2)
    client = _client(cluster.urls["cache_aware"])  # type: ignore[attr-defined]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=N)
    from engine.serving.loading import load_tokenizer

    ids = load_tokenizer("tiny")(prompt).input_ids
    assert r.choices[0].text == plain_engine(ids, N)
    assert r.usage is not None and r.usage.model_extra["kvstore"]["decode_worker"] == "d0"


def _turns(client: openai.OpenAI, seed: int) -> tuple[dict, dict]:
    """Two turns of one conversation; returns each turn's usage.kvstore."""
    msgs = _conversation(seed)
    r1 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N)
    msgs += [
        {"role": "assistant", "content": r1.choices[0].message.content or ""},
        {"role": "user", "content": "And what should happen when a cache machine dies?"},
    ]
    r2 = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=N)
    assert r2.choices[0].message.content == plain_engine(chat_ids(msgs), N)
    return r1.usage.model_extra["kvstore"], r2.usage.model_extra["kvstore"]  # type: ignore[union-attr]


def test_second_turn_goes_to_the_prefix_holder(cluster: ServingCluster) -> None:
    first, second = _turns(_client(cluster.urls["cache_aware"]), seed=3)  # type: ignore[attr-defined]
    assert first["cached_tokens"] == 0
    assert second["prefill_worker"] == first["prefill_worker"]
    # the whole first-turn prompt's full blocks were reused (688 tokens -> 43 blocks)
    assert second["cached_tokens"] >= (len(chat_ids(_conversation(3))) // 16) * 16
    assert second["tier"] == "dram"


def test_a_next_turn_finds_the_answer_stored_beside_its_prompt(cluster: ServingCluster) -> None:
    """d0 runs with --save-decode: once an answer is whole, its full blocks go to the
    node holding its prompt's (the prefill worker's), so a next turn that repeats the
    answer is placed there and finds prompt and answer both. Prompts are token ids: a
    chat's text is tokenized again, which need not give the generated ids back."""
    from engine.serving.loading import load_tokenizer

    client = _client(cluster.urls["cache_aware"])  # type: ignore[attr-defined]
    p = list(load_tokenizer("tiny")(words(300, 21)).input_ids)
    answer = plain_ids(p, 48)
    r1 = client.completions.create(model="tiny", prompt=p, max_tokens=48)
    assert r1.choices[0].text == load_tokenizer("tiny").decode(answer, skip_special_tokens=True)
    nxt = p + answer + list(load_tokenizer("tiny")(words(30, 22)).input_ids)
    r2 = client.completions.create(model="tiny", prompt=nxt, max_tokens=4)
    first, second = (r.usage.model_extra["kvstore"] for r in (r1, r2))  # type: ignore[union-attr]
    assert second["prefill_worker"] == first["prefill_worker"]
    whole = (len(p) + len(answer) - 1) // 16 * 16  # the answer's last token has no KV
    assert second["cached_tokens"] == whole > len(p)
    want, gap = plain_greedy(nxt, 4)  # the decode-made KV rounds unlike a cold prefill
    assert gap > 1e-3, "the reference has a near tie: float rounding may pick either"
    assert r2.choices[0].text == want


def test_round_robin_sends_the_second_turn_elsewhere(cluster: ServingCluster) -> None:
    url = cluster.urls.setdefault("round_robin", cluster.add_router("--policy", "round_robin"))  # type: ignore[attr-defined]
    first, second = _turns(_client(url), seed=4)
    assert second["prefill_worker"] != first["prefill_worker"]
    assert second["cached_tokens"] == 0  # the other worker's store node holds none of it
    metrics = httpx.get(url + "/metrics").text
    assert (
        'kvstore_router_decisions_total{phase="prefill",policy="round_robin",worker="p0"}'
        in metrics
    )


def test_short_prompt_skips_the_prefill_pool(cluster: ServingCluster) -> None:
    url = cluster.urls["cache_aware"]  # type: ignore[attr-defined]
    msgs = [{"role": "user", "content": "What is a good first step?"}]
    body = {"model": "tiny", "messages": msgs, "max_tokens": N}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    kv = r.json()["usage"]["kvstore"]
    assert kv["short_prompt"] is True
    assert kv["prefill_worker"] == kv["decode_worker"] == "d0"
    assert r.headers["x-kvstore-prefill-worker"] == "d0"
    assert r.json()["choices"][0]["message"]["content"] == plain_engine(chat_ids(msgs), N)


def test_impossible_slo_gets_429(cluster: ServingCluster) -> None:
    url = cluster.add_router("--slo-ttft-ms", "0.001")
    with pytest.raises(openai.RateLimitError) as err:
        _client(url).chat.completions.create(model="tiny", messages=_conversation(5), max_tokens=N)
    assert err.value.response.headers["retry-after"] == "1"
    assert err.value.body["code"] == "ttft_slo"  # type: ignore[index]
    assert (
        'kvstore_router_refusals_total{policy="cache_aware"} 1.0'
        in httpx.get(url + "/metrics").text
    )


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        ({"model": "nope", "prompt": "hi"}, 404, "model"),
        ({"model": "tiny", "prompt": words(1500, 6), "max_tokens": 8}, 400, "prompt"),
        (
            {
                "model": "tiny",
                "max_tokens": 8,
                "messages": [{"role": "user", "content": words(1500, 7)}],
            },
            400,
            "messages",
        ),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 4, "n": 2}, 400, "n"),
    ],
    ids=[
        "malformed-json",
        "unknown-model",
        "prompt-too-long",
        "new-chat-too-long",
        "max-tokens-0",
        "n-2",
    ],
)
def test_bad_requests_get_openai_errors(cluster: ServingCluster, body, status, param) -> None:
    chat = isinstance(body, dict) and "messages" in body
    path = "/v1/chat/completions" if chat else "/v1/completions"
    url = cluster.urls["cache_aware"] + path  # type: ignore[attr-defined]
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    if param in ("prompt", "messages"):
        assert err["code"] == "context_length_exceeded"


def test_models_and_health(cluster: ServingCluster) -> None:
    url = cluster.urls["cache_aware"]  # type: ignore[attr-defined]
    assert [m.id for m in _client(url).models.list()] == ["tiny"]
    h = httpx.get(url + "/health").json()
    assert h["workers"] == {"prefill": 2, "decode": 1, "both": 0}
    m = httpx.get(url + "/metrics").text
    assert "kvstore_router_ttft_seconds_bucket" in m

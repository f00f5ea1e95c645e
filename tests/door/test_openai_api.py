"""The OpenAI API of the router, driven by the official `openai` client against a real
deployment of processes (router, verifier, two drafters: the demo pair over HTTP/2 with
mutual TLS), and every role's /metrics read with prometheus-client's own parser."""

from __future__ import annotations

import json
import math
import time

import httpx
import openai
import pytest
import torch
from door_support import (
    MODEL_NAME,
    demo_cluster,
    greedy_text,
    metrics_url,
    scrape,
    wait_live,
)

from sdcp_fast.core.problems import Kind
from sdcp_fast.drafter import rounds_from_file
from sdcp_fast.models import load_backend
from sdcp_fast.router.chat import fallback_text

pytestmark = pytest.mark.timeout(240)
PROMPT = "def parse_args(argv=None):\n    parser = argparse.ArgumentParser("
ROLES = ("router", "verifier", "drafter-1", "drafter-2")


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    cluster = demo_cluster(tmp_path_factory.mktemp("door"))
    try:
        cluster.start(timeout=90)
        # scraped before any request: every series must already be there, at zero
        at_start = {name: scrape(metrics_url(cluster, name)) for name in ROLES}
        wait_live(cluster)
        base = f"{cluster.instances['router'].frontdoor_url}/v1"
        client = openai.OpenAI(base_url=base, api_key="unused", timeout=120, max_retries=0)
        yield cluster, client, at_start
        client.close()
    finally:
        cluster.stop()


def target():
    return load_backend("tiny:demo-target")


# ---------------------------------------------------------------------- completions


def test_models_lists_the_served_model(door):
    _, client, _ = door
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completion_is_the_target_alone_with_usage(door):
    _, client, _ = door
    prompt_ids = target().encode(PROMPT)
    tokens, text = greedy_text(prompt_ids, 40)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == \
        (len(prompt_ids), 40, len(prompt_ids) + 40)
    assert r.object == "text_completion" and r.model == MODEL_NAME


def test_streamed_completion_equals_the_whole_one_and_ends_with_done(door):
    cluster, client, _ = door
    _, text = greedy_text(target().encode(PROMPT), 32)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=32, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 32
    # the raw stream: server-sent events ending with data: [DONE]
    url = f"{cluster.instances['router'].frontdoor_url}/v1/completions"
    with httpx.stream("POST", url, json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4,
                                         "temperature": 0, "stream": True}, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"
    data = [line for line in lines if line.startswith("data: ")]
    ids = [int(line[4:]) for line in lines if line.startswith("id: ")]
    assert len(data) + len(ids) == len(lines) and len(ids) == len(data) - 1   # [DONE] has no id
    assert ids == sorted(ids) and ids[-1] == 4                 # completion tokens covered so far
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_resumes_from_its_last_event_id(door, chat):
    """GET /v1/[chat/]completions/{id}/stream with Last-Event-ID (or from=): the rest of the
    text exactly as the first stream sent it, then the finish chunk, usage and [DONE]."""
    cluster, _, _ = door
    base = cluster.instances["router"].frontdoor_url
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL_NAME, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT})}

    def events(response) -> list[tuple[int | None, str]]:
        out, event_id = [], None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("data: "):
                out.append((event_id, line[6:]))
                event_id = None
        return out

    def text_of(evs) -> str:
        chunks = [json.loads(d) for _, d in evs if d != "[DONE]"]
        key = (lambda c: c["delta"].get("content") or "") if chat else (lambda c: c["text"])
        return "".join(key(c["choices"][0]) for c in chunks if c["choices"])

    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        first = events(r)
    cid = json.loads(first[0][1])["id"]
    assert cid.startswith("chatcmpl-" if chat else "cmpl-")
    cut = len(first) // 2
    last_id = first[cut - 1][0]
    with httpx.stream("GET", f"{base}{path}/{cid}/stream", headers={"Last-Event-ID": str(last_id)},
                      timeout=60) as r:
        assert r.status_code == 200
        rest = events(r)
    assert text_of(first[:cut]) + text_of(rest) == text_of(first)
    assert [d for _, d in rest][-1] == "[DONE]"
    assert json.loads(rest[-2][1])["usage"]["completion_tokens"] == 24
    with httpx.stream("GET", f"{base}{path}/{cid}/stream?from=0", timeout=60) as r:
        assert text_of(events(r)) == text_of(first)
    other = "/v1/completions" if chat else "/v1/chat/completions"
    assert httpx.get(f"{base}{other}/{cid}/stream", timeout=10).status_code == 404
    assert httpx.get(f"{base}{path}/{cid}/stream?from=x", timeout=10).status_code == 400


def test_prompt_as_token_ids(door):
    _, client, _ = door
    prompt_ids = target().encode(PROMPT)
    _, text = greedy_text(prompt_ids, 8)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt_ids, max_tokens=8, temperature=0)
    assert r.choices[0].text == text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(door, stream):
    """The stop string is matched on the text (here it spans two tokens of the byte
    tokenizer); the text before it is returned, nothing after it is ever sent."""
    _, client, _ = door
    prompt_ids = target().encode(PROMPT)
    tokens, text = greedy_text(prompt_ids, 48)
    start = next(i for i in range(6, len(text) - 2) if text[i:i + 2].strip() and text[i:i + 2] not in text[:i + 1])
    stop = text[start:start + 2]
    expected = text[:text.find(stop)]
    used = len(target().encode(text[:text.find(stop) + len(stop)]))
    if stream:
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=0,
                                                stop=[stop, "never-seen"], stream=True,
                                                stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=48, temperature=0, stop=stop)
        got, finish, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
    assert got == expected
    assert finish == ["stop"]
    assert usage.completion_tokens == used


def test_sampling_request_runs_under_rule_2(door):
    _, client, _ = door
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0.8,
                                  top_p=0.9, seed=7, extra_body={"top_k": 20})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16


# ---------------------------------------------------------------------- chat


def test_chat_completion_uses_the_fallback_template(door):
    """The demo's byte tokenizer has no chat template: the documented plain fallback."""
    _, client, _ = door
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "import os"}]
    prompt_ids = target().encode(fallback_text(messages))
    _, text = greedy_text(prompt_ids, 24)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(prompt_ids)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=24,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 17}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "n": 0}, 400, "n"),
    ({"model": MODEL_NAME, "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": MODEL_NAME, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"model": MODEL_NAME, "prompt": "x", "logprobs": 1, "logprobs_mode": "raw_logits"}, 400, "logprobs_mode"),
    ({"model": MODEL_NAME, "prompt": "x", "top_logprobs": 2}, 400, "top_logprobs"),
    ({"model": MODEL_NAME, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": MODEL_NAME, "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL_NAME, "prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),   # context 4096
    ({"model": MODEL_NAME, "prompt": "x", "stop": 5}, 400, "stop"),
    ({"model": MODEL_NAME, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": [1, 300]}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL_NAME, "prompt": "x", "stream": "yes"}, 400, "stream"),
])
def test_bad_requests_get_openai_errors(door, body, status, param):
    cluster, _, _ = door
    r = httpx.post(f"{cluster.instances['router'].frontdoor_url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]


def test_bad_requests_raise_the_clients_exceptions(door):
    _, client, _ = door
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                       temperature=-1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL_NAME, messages=[])


# ---------------------------------------------------------------------- a client that goes away


def test_disconnect_cancels_the_session_at_verifier_and_drafters(door):
    cluster, client, _ = door
    verifier, router = metrics_url(cluster, "verifier"), metrics_url(cluster, "router")
    aborted = scrape(router)[("sdcp_request_success_total", (("finished_reason", "abort"),))]
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3000, temperature=0,
                                       stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    # the session ends everywhere: no longer served by the verifier, no drafter loop left,
    # and the verifier commits nothing more for it
    deadline = time.monotonic() + 30
    while True:
        v = scrape(verifier)
        drafting = sum(scrape(metrics_url(cluster, d))[("sdcp_drafter_sessions", ())] for d in ROLES[2:])
        if v[("sdcp_sessions", ())] == 0 and drafting == 0:
            break
        assert time.monotonic() < deadline, (v[("sdcp_sessions", ())], drafting)
        time.sleep(0.2)
    committed = v[("sdcp_spec_decode_num_draft_tokens_total", ())]
    time.sleep(1.0)
    assert scrape(verifier)[("sdcp_spec_decode_num_draft_tokens_total", ())] == committed
    r = scrape(router)
    assert r[("sdcp_request_success_total", (("finished_reason", "abort"),))] == aborted + 1
    assert r[("sdcp_num_requests_running", ())] == 0
    generations = httpx.get(f"{cluster.instances['router'].frontdoor_url}/v1/generations", timeout=10).json()
    assert any(g["finish_reason"] == "abort" for g in generations["generations"])


# ---------------------------------------------------------------------- metrics


VERIFIER_SERIES = [
    "sdcp_spec_decode_num_drafts_total", "sdcp_spec_decode_num_draft_tokens_total",
    "sdcp_spec_decode_num_accepted_tokens_total", "sdcp_self_decoded_tokens_total",
    "sdcp_fenced_appends_total", "sdcp_proposals_total", "sdcp_batch_size_count",
    "sdcp_queue_wait_seconds_count", "sdcp_forward_seconds_count", "sdcp_kernel_seconds_count",
    "sdcp_commit_log_append_seconds_count", "sdcp_sessions", "sdcp_load_percent",
]
ROUTER_SERIES = [
    "sdcp_num_requests_running", "sdcp_num_requests_waiting", "sdcp_time_to_first_token_seconds_count",
    "sdcp_inter_token_latency_seconds_count", "sdcp_e2e_request_latency_seconds_count",
    "sdcp_prompt_tokens_total", "sdcp_generation_tokens_total",
]
DRAFTER_SERIES = ["sdcp_drafter_sessions", "sdcp_draft_seconds_count", "sdcp_drafter_draft_tokens_total"]
PROCESS_SERIES = ["process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"]


def test_every_series_exists_at_zero_before_the_first_request(door):
    _, _, at_start = door
    v, r = at_start["verifier"], at_start["router"]
    for name in VERIFIER_SERIES:
        assert v[(name, ())] == 0, name
    for action in ("continue", "reduce", "switch", "self_decode", "finish", "fail"):
        assert v[("sdcp_verdicts_total", (("action", action),))] == 0
    for action in ("reduce", "switch", "self_decode", "fail"):
        assert v[("sdcp_escalations_total", (("action", action),))] == 0
    for kind in Kind:       # every problem type the verifier can answer, not only the common one
        assert v[("sdcp_problems_total", (("type", kind.suffix),))] == 0, kind
    assert v[("sdcp_spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 0
    for name in ROUTER_SERIES:
        assert r[(name, ())] == 0, name
    for reason in ("stop", "length", "abort", "fail"):
        assert r[("sdcp_request_success_total", (("finished_reason", reason),))] == 0
    for drafter in ROLES[2:]:
        d = at_start[drafter]
        for name in DRAFTER_SERIES:
            assert d[(name, ())] == 0, name
        assert d[("sdcp_drafter_proposals_total", (("outcome", "verdict"),))] == 0
        assert d[("sdcp_drafter_draft_ahead", ())] == -1    # measuring both ways until its rounds tell
    for role in ROLES:
        assert all(any(key[0] == name for key in at_start[role]) for name in PROCESS_SERIES), role


def test_series_move_and_the_acceptance_rate_is_the_drafters_own_count(door):
    """The README's acceptance rate, accepted_tokens / draft_tokens from the verifier's
    metrics, equals the demo's own count: the rounds the drafters logged."""
    cluster, client, _ = door
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=40, temperature=0)
    # rounds under way when a stream above was cancelled may land late: wait until quiet
    def spec_decode():
        v = scrape(metrics_url(cluster, "verifier"))
        return v, [value for (name, _), value in sorted(v.items()) if name.startswith("sdcp_spec_decode")]

    v, previous = spec_decode()
    while True:
        time.sleep(0.5)
        v, now = spec_decode()
        if now == previous:
            break
        previous = now
    records = [r for d in ROLES[2:] for r in rounds_from_file(cluster.workdir / f"{d}.rounds.jsonl")
               if not r.get("dropped")]
    drafted, accepted = sum(r["m"] for r in records), sum(r["accepted"] for r in records)
    assert v[("sdcp_spec_decode_num_draft_tokens_total", ())] == drafted > 0
    assert v[("sdcp_spec_decode_num_accepted_tokens_total", ())] == accepted
    assert v[("sdcp_spec_decode_num_drafts_total", ())] == len(records)
    rate = v[("sdcp_spec_decode_num_accepted_tokens_total", ())] / v[("sdcp_spec_decode_num_draft_tokens_total", ())]
    assert rate == pytest.approx(accepted / drafted)
    per_pos = sum(value for (name, _), value in v.items()
                  if name == "sdcp_spec_decode_num_accepted_tokens_per_pos_total")
    assert per_pos == accepted
    r = scrape(metrics_url(cluster, "router"))
    assert r[("sdcp_generation_tokens_total", ())] >= 40
    assert r[("sdcp_time_to_first_token_seconds_count", ())] >= 1
    assert r[("sdcp_e2e_request_latency_seconds_count", ())] >= 1
    assert r[("sdcp_inter_token_latency_seconds_count", ())] > 0
    assert r[("sdcp_request_success_total", (("finished_reason", "length"),))] >= 1
    drafted_here = sum(scrape(metrics_url(cluster, d))[("sdcp_drafter_draft_tokens_total", ())] for d in ROLES[2:])
    assert drafted_here == drafted
    # the front door serves the router's series as well, and /health
    front = cluster.instances["router"].frontdoor_url
    assert ("sdcp_generation_tokens_total", ()) in scrape(f"{front}/metrics")
    assert httpx.get(f"{front}/health", timeout=10).json()["status"] == "ok"


def test_health_of_every_role(door):
    cluster, _, _ = door
    for name in ROLES:
        port = cluster.instances[name].info["metrics_port"]
        answer = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
        assert answer.status_code == 200 and answer.json()["status"] == "ok", (name, answer.text)


def test_logs_are_quiet_about_http_requests_and_say_where_each_instance_is(door):
    cluster, _, _ = door
    for name in ROLES:
        text = cluster.instances[name].log_path.read_text()
        assert "HTTP Request:" not in text, name            # httpx at INFO
        ready = [line for line in text.splitlines() if " ready: " in line]
        assert len(ready) == 1, name
        assert "SDCP https://127.0.0.1:" in ready[0]
        if name == "router":
            assert "OpenAI API at http://127.0.0.1:" in ready[0]
        else:
            assert "/metrics" in ready[0] and "/health" in ready[0]


# ---------------------------------------------------------------------- log-probabilities, n, echo


def target_logprobs(prompt_ids: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The target alone: log_softmax (float64) of its logits at each token's context."""
    backend = target()
    backend.open(b"lp", prompt_ids)
    rows = []
    for token in tokens:
        rows.append(torch.log_softmax(backend.score([(b"lp", [])])[-1].double(), dim=-1))
        backend.commit(b"lp", [token])
    return rows


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_are_the_targets_own(door, stream):
    cluster, client, _ = door
    url = f"{cluster.instances['router'].frontdoor_url}/v1/completions"
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3,
            "return_tokens_as_token_ids": True, "stream": stream}
    if stream:
        chunks = [json.loads(line[6:]) for line in httpx.post(url, json=body, timeout=60).text.splitlines()
                  if line.startswith("data: {")]
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        lp = {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs")}
    else:
        lp = httpx.post(url, json=body, timeout=60).json()["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    expected, _ = greedy_text(target().encode(PROMPT), 12)
    assert tokens == expected
    for n, row in enumerate(target_logprobs(target().encode(PROMPT), tokens)):
        assert abs(lp["token_logprobs"][n] - float(row[tokens[n]])) < 1e-4
        top = lp["top_logprobs"][n]
        values, ids = torch.topk(row, 3)
        assert list(top) == [f"token_id:{i}" for i in ids.tolist()]
        assert all(abs(a - b) < 1e-4 for a, b in zip(top.values(), values.tolist(), strict=True))


def test_chat_logprobs_and_processed_mode(door):
    _, client, _ = door
    messages = [{"role": "user", "content": "def main():"}]
    raw = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                         logprobs=True, top_logprobs=2)
    content = raw.choices[0].logprobs.content
    assert "".join(c.token for c in content) == raw.choices[0].message.content
    for c in content:
        assert [t.logprob for t in c.top_logprobs] == sorted((t.logprob for t in c.top_logprobs), reverse=True)
        assert c.logprob <= 0 and sum(math.exp(t.logprob) for t in c.top_logprobs) <= 1 + 1e-9
    processed = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=2,
                                               extra_body={"logprobs_mode": "processed_logprobs"})
    # greedy: p is one-hot on the argmax, so each token's processed log p is 0 and the runner-up excluded
    assert [c.logprob for c in processed.choices[0].logprobs.content] == [0.0] * len(content)
    assert all(c.top_logprobs[1].logprob == -9999.0 for c in processed.choices[0].logprobs.content)


def test_n_choices_share_one_prefill_and_seeds_differ(door):
    cluster, client, _ = door
    log = cluster.instances["verifier"].log_path
    before = log.read_text().count("from a shared prefill")
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2, seed=7)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 32
    assert log.read_text().count("from a shared prefill") == before + 1
    # the verifier's draws are keyed by the seed and the session id (section 6.4), so a seed
    # does not repeat a sample across requests: streamed, two choices again, each whole
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, n=2,
                                            seed=7, stream=True, stream_options={"include_usage": True}))
    finishes = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices
                and c.choices[0].finish_reason}
    assert finishes == {0: "length", 1: "length"} and chunks[-1].usage.completion_tokens == 32
    assert len({c.id for c in chunks}) == 1      # one completion, whichever choice a chunk carries


def test_echo_puts_the_prompt_first(door):
    _, client, _ = door
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    echoed = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + whole.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == echoed.choices[0].text


def test_tokenize_detokenize_and_model_length(door):
    cluster, client, _ = door
    base = cluster.instances["router"].frontdoor_url
    tokens = httpx.post(f"{base}/tokenize", json={"model": MODEL_NAME, "prompt": PROMPT}, timeout=10).json()
    assert tokens["tokens"] == target().encode(PROMPT) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == 4096
    text = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}, timeout=10).json()
    assert text == {"prompt": PROMPT}
    chat = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=10).json()
    assert chat["tokens"] == target().encode(fallback_text([{"role": "user", "content": "hi"}]))
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [1, 1 << 20]}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 4096
    unsupported = httpx.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "add_generation_prompt": False}, timeout=10)
    assert unsupported.status_code == 400 and unsupported.json()["error"]["param"] == "add_generation_prompt"

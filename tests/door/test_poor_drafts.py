"""A request must not fail because its draft model is poor while the target can decode it
(issue 19): the prompt "x" with the router's default contract and a draft that never
agrees with the target finishes with length, never fail, and when the verifier is too
loaded to decode the session itself the router places it again rather than failing it."""

from __future__ import annotations

import openai
import pytest
from door_support import (
    MODEL_NAME,
    demo_cluster,
    greedy_text,
    metrics_url,
    never_agreeing_draft,
    scrape,
    wait_live,
)

from sdcp_fast.models import load_backend

pytestmark = pytest.mark.timeout(240)


def run_x(tmp_path, contract: dict | None, max_tokens: int):
    cluster = demo_cluster(tmp_path, drafters=1, draft=never_agreeing_draft(tmp_path), contract=contract)
    try:
        cluster.start(timeout=90)
        wait_live(cluster)
        client = openai.OpenAI(base_url=f"{cluster.instances['router'].frontdoor_url}/v1", api_key="unused",
                               timeout=180, max_retries=0)
        r = client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=max_tokens, temperature=0)
        return r, scrape(metrics_url(cluster, "verifier")), scrape(metrics_url(cluster, "router"))
    finally:
        cluster.stop()


def test_prompt_x_with_a_draft_that_never_agrees_finishes_under_the_default_contract(tmp_path):
    """The default ladder (reduce, switch, self_decode) ends in self-decoding, which lasts
    while the verifier's load allows (no self_max): the target finishes the request."""
    r, v, router = run_x(tmp_path, None, 48)
    _, text = greedy_text(load_backend("tiny:demo-target").encode("x"), 48)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == text                      # still the target's greedy output
    assert v[("sdcp_spec_decode_num_accepted_tokens_total", ())] == 0   # the draft never agreed
    assert v[("sdcp_escalations_total", (("action", "self_decode"),))] == 1
    assert v[("sdcp_escalations_total", (("action", "fail"),))] == 0
    assert v[("sdcp_self_decoded_tokens_total", ())] > 0
    assert router[("sdcp_request_success_total", (("finished_reason", "fail"),))] == 0


def test_a_verifier_too_loaded_to_self_decode_gets_the_session_placed_again(tmp_path):
    """self_load = 0: the verifier may never decode the session itself, so the ladder runs out
    and the verifier ends the session with fail. The contract did not ask for fail: the
    router fences the log and resumes the session (a fresh ladder), until it is done."""
    r, v, router = run_x(tmp_path, {"self_load": 0, "low_rounds": 2}, 24)
    _, text = greedy_text(load_backend("tiny:demo-target").encode("x"), 24)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text == text
    assert v[("sdcp_escalations_total", (("action", "fail"),))] >= 1          # the verifier did fail it ...
    assert router[("sdcp_replacements_total", (("why", "unasked_fail"),))] >= 1   # ... and it was re-placed
    assert router[("sdcp_request_success_total", (("finished_reason", "fail"),))] == 0

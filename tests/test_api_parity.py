"""What real clients need from the API (issue 17), against a real ``phasewise serve``:
``echo`` and prompt logprobs on /v1/completions (checked against HF transformers' own
logprobs, fp32), ``max_tokens: 0``, vLLM's ``prompt_logprobs``, ``GET /v1/models/{id}``,
``GET /tokenizer_info``, and lm-evaluation-harness's ``local-completions`` running a
multiple-choice task end to end with the server's tokenizer."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch

from conftest import build_hf_checkpoint
from phasewise.model.tokenizer import Tokenizer
from serving import start_server

TOL = 2e-4  # fp32 server against fp32 HF: the same math in another order


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("parity")
    hf = build_hf_checkpoint(path, "LlamaForCausalLM", seed=11, max_position_embeddings=1024)
    return path, hf


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    s = start_server(model[0], tmp_path_factory.mktemp("logs") / "server.log",
                     "--served-model-name", "tiny", "--dtype", "float32",
                     "--max-num-batched-tokens", "32")  # long prompts prefill in chunks
    yield s
    s.stop()


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def post(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_logprobs_scores_the_prompt_as_hf_does(server, model):
    path, hf = model
    tok = Tokenizer(path)
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3,
                     add_special_tokens=False)
    assert len(ids) > 64  # more than two of the server's 32-token chunks
    out = post(server, {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": 1,
                        "temperature": 0})
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1  # the prompt, then the one generated token
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = hf_logprobs(hf, ids)
    for pos in range(1, len(ids)):
        assert abs(lp["token_logprobs"][pos] - float(ref[pos - 1, ids[pos]])) < TOL, pos
        # the top 2 and the prompt token itself, keyed by their text (two byte tokens that
        # both decode to U+FFFD share a key, as in OpenAI's layout)
        top = lp["top_logprobs"][pos]
        allowed = torch.topk(ref[pos - 1], 2).values.tolist() + [float(ref[pos - 1, ids[pos]])]
        assert 1 <= len(top) <= 3
        assert all(min(abs(v - a) for a in allowed) < TOL for v in top.values())
    generated = int(ref[-1].argmax())
    assert abs(lp["token_logprobs"][-1] - float(ref[-1, generated])) < TOL
    plain = post(server, {"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert choice["text"] == (tok.decode(ids, skip_special_tokens=False)
                              + plain["choices"][0]["text"])
    assert lp["text_offset"] == sorted(lp["text_offset"])
    assert out["usage"]["prompt_tokens"] == len(ids)
    assert out["usage"]["completion_tokens"] == 1


def test_max_tokens_zero_echoes_the_prompt_and_generates_nothing(server, model):
    prompt = "import os, sys\nfor path in sys.argv[1:]:"
    out = post(server, {"prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0})
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    n = out["usage"]["prompt_tokens"]
    assert len(choice["logprobs"]["token_logprobs"]) == n
    assert out["usage"]["completion_tokens"] == 0
    # without echo, max_tokens 0 is an empty completion; its prompt counts in /metrics
    before = server.wait_idle()[("phasewise:prompt_tokens_total", ())]
    out = post(server, {"prompt": prompt, "max_tokens": 0})
    after = server.wait_idle()[("phasewise:prompt_tokens_total", ())]
    assert after - before == out["usage"]["prompt_tokens"]
    assert out["choices"][0]["text"] == "" and out["usage"]["completion_tokens"] == 0
    r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": -1},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field(server, model):
    path, hf = model
    ids = Tokenizer(path).encode("class Stack:\n    def push(self, x):", add_special_tokens=False)
    out = post(server, {"prompt": ids, "prompt_logprobs": 3, "max_tokens": 2,
                        "temperature": 0})
    plp = out["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(hf, ids)
    assert plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert str(ids[pos]) in entry and len(entry) in (3, 4)
        assert abs(entry[str(ids[pos])]["logprob"] - float(ref[pos - 1, ids[pos]])) < TOL
        top = torch.topk(ref[pos - 1], 3)
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[str(t)]["logprob"] - v) < TOL
        assert all(isinstance(e["decoded_token"], str) for e in entry.values())
    assert "prompt_logprobs" not in post(server, {"prompt": ids, "max_tokens": 1})["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_n_samples_share_one_prompts_logprobs(server, model, stream):
    """Each prompt's logprobs are computed by its first sample only; every choice carries
    them, as n separate requests' would (echo's prompt entries too)."""
    ids = Tokenizer(model[0]).encode("def area(r):\n    return 3.14 * r", add_special_tokens=False)
    one = post(server, {"prompt": ids, "prompt_logprobs": 2, "echo": True, "logprobs": 1,
                        "max_tokens": 2, "temperature": 0})["choices"][0]
    body = {"prompt": [ids, ids[:5]], "n": 3, "prompt_logprobs": 2, "echo": True,
            "logprobs": 1, "max_tokens": 2, "temperature": 1.0, "seed": 5}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=120,
                          json=dict(body, stream=True)) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        firsts: dict[int, dict] = {}
        for e in events:
            for c in e["choices"]:
                firsts.setdefault(c["index"], c)
        choices = [firsts[i] for i in range(6)]
    else:
        choices = post(server, body)["choices"]
    echo_len = len(one["logprobs"]["tokens"]) - 2
    for i, c in enumerate(choices):
        want = one if i < 3 else None
        assert c["prompt_logprobs"][0] is None
        if want is not None:
            assert c["prompt_logprobs"] == want["prompt_logprobs"], i
            assert (c["logprobs"]["token_logprobs"][:echo_len]
                    == want["logprobs"]["token_logprobs"][:echo_len]), i
        else:
            assert len(c["prompt_logprobs"]) == 5 and c["prompt_logprobs"] == \
                choices[3]["prompt_logprobs"]


def test_only_each_prompts_first_sample_computes_its_logprobs():
    from types import SimpleNamespace

    from phasewise import SamplingParams
    from phasewise.server.routes import Routes

    fake = SimpleNamespace(_ids=lambda *a: None, _params=lambda o: SamplingParams(**o))
    specs = Routes._specs(fake, [([1, 2, 3], None, 4), ([4, 5], None, 4)], 3,
                          {"prompt_logprobs": 2, "seed": 7})
    assert [s.params.prompt_logprobs for s in specs] == [2, None, None, 2, None, None]
    assert [s.params.seed for s in specs] == [7, 8, 9, 7, 8, 9]


def test_held_samples_go_out_with_their_first_samples_prompt_logprobs():
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics
    from phasewise.server.sse import SharedPromptLogprobs

    def out(i, n_tokens, plp=None):
        return RequestOutput(f"r{i}", None, [1, 2], "t" * n_tokens, list(range(n_tokens)),
                             "t", [n_tokens - 1], False, None, None, None, RequestMetrics(0.0),
                             prompt_logprobs=plp)

    share = SharedPromptLogprobs(3)
    assert share.ready(1, out(1, 1)) == [] and share.ready(1, out(1, 2)) == []
    assert share.ready(2, out(2, 1)) == []
    lead = share.ready(0, out(0, 1, plp=[None, {2: -0.1}]))
    assert [i for i, _ in lead] == [0, 1, 2]
    assert all(o.prompt_logprobs == [None, {2: -0.1}] for _, o in lead)
    assert lead[1][1].delta_token_ids == [0, 1]  # the held outputs merged, none lost
    (later,) = share.ready(1, out(1, 3))
    assert later[1].prompt_logprobs == [None, {2: -0.1}]
    assert share.ready(3, out(3, 1, plp=[None, {1: -2.0}]))[0][1].prompt_logprobs[1] == \
        {1: -2.0}  # the next prompt's samples have their own


def test_echo_streams_the_prompt_first(server):
    prompt = "The quick brown fox"
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "echo": True, "max_tokens": 4, "stream": True,
            "temperature": 0}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts[0].startswith(prompt)
    whole = post(server, {"prompt": prompt, "echo": True, "max_tokens": 4, "temperature": 0})
    assert "".join(texts) == whole["choices"][0]["text"]


def test_models_by_id_and_tokenizer_info(server, model):
    r = httpx.get(server.url + "/v1/models/tiny", timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "tiny"
    r = httpx.get(server.url + "/v1/models/gpt-4", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    info = httpx.get(server.url + "/tokenizer_info", timeout=30).json()
    tok = Tokenizer(model[0])
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == 1024
    assert info["vocab_size"] == tok.vocab_size


MC_DOCS = [
    {"question": "def fibonacci(n):", "choices": ["    return n", "The quick brown",
                                                  "    import sys"], "answer": 0},
    {"question": "class Stack:", "choices": ["    def push(self, x):", "fox jumps",
                                             "🙂 日本語"], "answer": 0},
    {"question": "The quick brown fox", "choices": ["jumps over", "self.items", "= []"],
     "answer": 0},
    {"question": "import os, sys", "choices": ["for path in", "Prefill is", "lazy dog"],
     "answer": 1},
    {"question": "Prefill is compute-bound;", "choices": ["decode is bound", "def f(",
                                                          "os.path"], "answer": 2},
]


def test_lm_eval_local_completions_runs_a_multiple_choice_task(server, model, tmp_path,
                                                               monkeypatch):
    """lm-eval scores each choice by the prompt logprobs it asks for with echo; its
    loglikelihoods, and so its accuracy, must be what HF's logprobs give."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in MC_DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": server.url + "/v1/completions",
                    "num_concurrent": 1, "max_retries": 1},
        tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True)
    path, hf = model
    tok = Tokenizer(path)
    correct = 0
    samples = results["samples"]["tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        doc = sample["doc"]
        scores = []
        for choice in doc["choices"]:  # lm-eval's pairing: context, then " " + the choice
            ctx = tok.encode(doc["question"], add_special_tokens=False)
            whole = tok.encode(doc["question"] + " " + choice, add_special_tokens=False)
            ref = hf_logprobs(hf, whole)
            scores.append(sum(float(ref[p - 1, whole[p]]) for p in range(len(ctx), len(whole))))
        got = [resp[0][0] if isinstance(resp[0], (list, tuple)) else resp[0]
               for resp in sample["resps"]]
        for mine, theirs in zip(got, scores):
            assert abs(float(mine) - theirs) < 1e-3, (doc, got, scores)
        correct += int(max(range(len(scores)), key=scores.__getitem__) == doc["answer"])
    assert "GET /tokenizer_info" in server.log()  # it took the server's tokenizer
    acc = results["results"]["tiny_mc"]["acc,none"]
    assert acc == pytest.approx(correct / len(MC_DOCS))


# -- structured output, through the clients that use it ----------------------------------------
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}


def test_response_format_json_schema_and_json_object_with_the_openai_client(server):
    import jsonschema
    import openai
    from pydantic import BaseModel, Field

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    for seed in range(3):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a person"}], max_tokens=120,
            seed=seed, temperature=1.0, response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)

    class Point(BaseModel):  # the SDK's own parse helper: a strict schema from pydantic
        x: int = Field(ge=-9, le=9)
        label: str = Field(max_length=4)

    parsed = client.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "a point"}], max_tokens=60,
        response_format=Point).choices[0].message.parsed
    assert isinstance(parsed, Point)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=80, seed=4,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].text.startswith("{")


def test_vllm_guided_fields_and_streaming(server):
    import jsonschema

    def complete(**extra) -> str:
        out = post(server, {"prompt": "x", "max_tokens": 80, "temperature": 1.0, "seed": 1,
                            **extra})
        assert out["choices"][0]["finish_reason"] == "stop", out
        return out["choices"][0]["text"]

    jsonschema.validate(json.loads(complete(guided_json=PERSON)), PERSON)
    jsonschema.validate(json.loads(complete(guided_json=json.dumps(PERSON))), PERSON)
    assert complete(guided_choice=["yes", "no"]) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", complete(guided_regex=r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"(ab)+", complete(guided_grammar='start: ("ab")+'))
    assert complete(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
    jsonschema.validate(json.loads(complete(structured_outputs={"json": PERSON})), PERSON)
    # streamed, the deltas add up to the document
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "prompt": "x", "max_tokens": 80, "stream": True, "seed": 2,
            "guided_json": PERSON}) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: ") and line != "data: [DONE]")
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("body,param,code", [
    ({"guided_regex": "("}, "guided_regex", "invalid_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "invalid_combination"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "invalid_combination"),
    ({"response_format": {"type": "xml"}}, "response_format.type", None),
    ({"guided_json": "{not json"}, "guided_json", "invalid_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "invalid_combination"),
    ({"guided_choice": []}, "guided_choice", None),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "invalid_grammar"),  # cannot start
    ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json", "invalid_grammar"),
])
def test_bad_constraints_are_400s_naming_the_field(server, body, param, code):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == code, err


def test_a_grammar_whose_check_runs_too_long_is_refused(model):
    """The check runs in a child process under a time budget, and one that outlasts it is
    killed there and refused here (a grammar whose first steps are slow would hold the engine
    thread as long). No bound foresees such a grammar, so this checker skips the bounds."""
    import asyncio

    from phasewise.config import EngineConfig
    from phasewise.engine.async_engine import AsyncEngine
    from phasewise.engine.structured import spec_json
    from phasewise.server import routes as routes_mod
    from phasewise.server.errors import ApiError
    from phasewise.server.grammar_check import GrammarChecker

    engine = AsyncEngine.from_config(EngineConfig(model=str(model[0])))
    routes = routes_mod.Routes(engine, "tiny")
    compiler = engine.grammars
    routes._grammar_checker = GrammarChecker(
        compiler.tokenizer_json, tuple(compiler.eos), compiler.vocab_size, timeout_s=0.3,
        bounds=False, memory_bytes=2**31, warm=compiler.check, is_warm=compiler.cached)
    overrides: dict = {}
    slow = spec_json("regex", "(a{1000}){1000}")
    with pytest.raises(ApiError) as err:
        asyncio.run(routes._constrain(overrides, "guided_regex", slow))
    assert err.value.status == 400 and err.value.param == "guided_regex"
    assert "more than 0.3 s" in err.value.message and "structured_output" not in overrides
    assert not compiler.cached(slow)  # the engine never compiled it
    asyncio.run(routes._constrain(overrides, "guided_regex", spec_json("regex", "ab+")))
    assert overrides["structured_output"] == spec_json("regex", "ab+")
    assert compiler.cached(spec_json("regex", "ab+"))  # warm for the engine
    routes.close()


def test_langchain_and_litellm_get_structured_output(server, monkeypatch):
    from pydantic import BaseModel, ConfigDict, Field

    class Pet(BaseModel):
        # no other properties: a random model's extra keys ran the reply past max_tokens
        model_config = ConfigDict(extra="forbid")
        name: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)

    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", max_tokens=60,
                      max_retries=0)
    pet = chat.with_structured_output(Pet, method="json_schema").invoke("a pet")
    assert isinstance(pet, Pet)

    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    r = litellm.completion(model="openai/tiny", api_base=server.url + "/v1", api_key="x",
                           messages=[{"role": "user", "content": "a pet"}], max_tokens=60,
                           response_format={"type": "json_schema", "json_schema": {
                               "name": "pet", "schema": Pet.model_json_schema()}})
    assert Pet.model_validate_json(r.choices[0].message.content)


# -- tools --------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": False}}}


def test_a_named_tool_call_round_trips_through_the_openai_client(server):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    r = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=60, seed=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    # the result goes back, and the conversation goes on
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                           tools=[WEATHER, TIME])
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_named_call_cut_by_a_stop_string_is_content_not_a_broken_call(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER], "stop": ['"'],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 40}).json()
    choice = r["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == "{"  # cut at the first quote


def test_required_tool_calls_always_parse_and_stream_as_deltas(server):
    import jsonschema

    body = {"messages": [{"role": "user", "content": "time and weather"}],
            "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 120,
            "parallel_tool_calls": False}
    for seed in range(3):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={**body, "seed": seed}).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for call in choice["message"]["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                schemas[call["function"]["name"]])
    # streamed: per call, a delta with its id and name, then its arguments; the same calls
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={**body, "seed": 0, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    calls: dict[int, dict] = {}
    for e in events:
        for tc in e["choices"][0]["delta"].get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            if "id" in tc:
                assert c["name"] is None and tc["function"]["arguments"] == ""
                c["name"], c["id"] = tc["function"]["name"], tc["id"]
            c["arguments"] += tc["function"].get("arguments", "")
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    whole = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                       json={**body, "seed": 0}).json()["choices"][0]["message"]["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole]


def test_auto_parses_hermes_blocks():
    from phasewise.server.tools import parse_hermes, parse_required, required_schema

    text = ('Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}'
            '\n</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text, {"get_time"})
    assert calls == [{"name": "get_time", "arguments": '{"zone": "utc"}'}]
    assert content.startswith("Let me look.") and "nope" in content  # unknown: left as text
    assert parse_hermes("just text", {"get_time"}) == ("just text", [])
    # the text a stream sends: leading whitespace kept, with calls the trailing dropped,
    # blank as None
    assert parse_hermes(' hi <tool_call>{"name": "get_time"}</tool_call>', {"get_time"}
                        )[0] == " hi"
    assert parse_hermes('\n<tool_call>{"name": "get_time"}</tool_call>', {"get_time"}
                        )[0] is None
    # an unclosed marker (or thousands of them) is text, found in one pass
    many = "<tool_call>" * 20000
    assert parse_hermes(many, {"get_time"}) == (many, [])
    schema = required_schema([WEATHER, TIME], parallel=False)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    # a name that is a list or an object names no tool (it was a 500: unhashable)
    for bad in ('[1]', '{}', '["get_time"]'):
        block = f'<tool_call>{{"name": {bad}}}</tool_call>'
        assert parse_hermes(block, {"get_time"}) == (block, [])
    assert parse_required('[{"name": ["get_time"]}, {"name": "get_time"}]') == [
        {"name": "get_time", "arguments": "{}"}]
    # arguments are JSON text however the model wrote them
    _, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": "str"}</tool_call>'
                            '<tool_call>{"name": "get_time", "arguments": "{\\"a\\": 1}"}'
                            '</tool_call>', {"get_time"})
    assert [c["arguments"] for c in calls] == ['"str"', '{"a": 1}']
    for written, sent in (('"NaN"', '"NaN"'), ('"5"', '"5"'), ('"[1]"', "[1]")):
        _, calls = parse_hermes(f'<tool_call>{{"name": "get_time", "arguments": {written}}}'
                                "</tool_call>", {"get_time"})
        assert calls[0]["arguments"] == sent, written


def test_auto_streams_content_until_a_tool_call_begins():
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics
    from phasewise.server.tools import ToolChatChoices

    pieces = ["Sure", ", <tool", '_call>{"name": "get_time", ', '"arguments": {"zone": "utc"}}',
              "</tool_call>", " Then", " done."]
    choices = ToolChatChoices(str, 1, None, mode="auto", names={"get_time"})
    text, chunks = "", []
    for i, p in enumerate(pieces):
        text += p
        last = i == len(pieces) - 1
        out = RequestOutput("r", None, [1], text, list(range(i + 1)), p, [i], last,
                            "stop" if last else None, None, None, RequestMetrics(0.0))
        chunks += [c for c, _ in choices.delta(0, out)]
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    # the marker and the call never show as text; what follows the call still comes
    assert content.split() == ["Sure,", "Then", "done."]
    assert "tool_call" not in content
    calls = [tc for c in chunks for tc in c["delta"].get("tool_calls", [])]
    assert calls[0]["function"] == {"name": "get_time", "arguments": ""}
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "utc"}
    assert chunks[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("text", [
    ' hello <tool_call>{"name": "get_time"}</tool_call> bye',
    'Sure,  \n<tool_call>{"name": "get_time"}</tool_call>\n',
    "  just text, no call  ",
    "\n\n",  # whitespace alone, no call: it is the content, streamed or whole
])
def test_auto_streams_the_content_its_whole_reply_has_wherever_deltas_end(text):
    """However the output's text is cut into deltas, the streamed content is the whole
    reply's (leading whitespace kept, the whitespace before calls dropped)."""
    from phasewise.engine.outputs import RequestOutput
    from phasewise.engine.request import RequestMetrics
    from phasewise.server.tools import ToolChatChoices

    def out(upto: int, last: bool) -> RequestOutput:
        return RequestOutput("r", None, [1], text[:upto], [1], "", [1], last,
                             "stop" if last else None, None, None, RequestMetrics(0.0))

    whole = ToolChatChoices(str, 1, None, mode="auto", names={"get_time"}).whole(
        0, out(len(text), True))["message"]["content"]
    for cuts in ([], *([k] for k in range(1, len(text))), list(range(1, len(text)))):
        choices = ToolChatChoices(str, 1, None, mode="auto", names={"get_time"})
        chunks = [c for k in cuts for c, _ in choices.delta(0, out(k, False))]
        chunks += [c for c, _ in choices.delta(0, out(len(text), True))]
        streamed = "".join(c["delta"].get("content") or "" for c in chunks)
        assert streamed == (whole or ""), cuts


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools.0.function.name"),
])
def test_bad_tool_requests_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_langchain_binds_tools_and_structures_by_function_calling(server):
    from langchain_core.messages import ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", max_tokens=60,
                      max_retries=0)

    class Pet(BaseModel):
        name: str = Field(max_length=6)
        legs: int = Field(ge=0, le=8)

    # LangChain's default method: a forced tool call whose arguments are the object
    assert isinstance(chat.with_structured_output(Pet).invoke("a pet"), Pet)
    bound = chat.bind_tools([WEATHER], tool_choice="get_weather")
    msg = bound.invoke("weather?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    follow = bound.invoke(["weather?", msg, ToolMessage(content="3C", tool_call_id=call["id"])])
    assert follow.tool_calls  # still forced: the conversation round-tripped


# -- the Responses API --------------------------------------------------------------------------
def test_responses_create_streams_the_same_text_with_openais_events(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    args = dict(model="tiny", instructions="be brief", max_output_tokens=12, temperature=0,
                input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}])
    whole = client.responses.create(**args)
    assert whole.object == "response" and whole.status == "incomplete"  # 12 tokens cut it
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    raw = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 3}).json()
    openai.types.responses.Response.model_validate(raw)  # strict: every required field
    events = list(client.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    # ended by a stop string: completed, and the SDK's stream helper gets its final response.
    # The stop string is a character of the greedy text, so the stream meets it for sure.
    free = client.responses.create(model="tiny", input="x", max_output_tokens=64,
                                   temperature=0).output_text
    printable = [c for c in free[1:] if c.isascii() and c.isprintable()]
    assert printable, free
    stop = printable[len(printable) // 2]
    with client.responses.stream(model="tiny", input="x", max_output_tokens=64, temperature=0,
                                 extra_body={"stop": [stop]}) as stream:
        list(stream)
        final = stream.get_final_response()
    assert final.status == "completed" and stop not in final.output_text
    assert free.startswith(final.output_text)


def test_responses_text_format_and_what_is_refused(server):
    import jsonschema
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="tiny", input="a person", max_output_tokens=120,
                                text={"format": {"type": "json_schema", "name": "person",
                                                 "schema": PERSON, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    for body, param in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
                        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
                        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
                         "input"),
                        ({"input": []}, "input"), ({"n": 2}, "n"),
                        ({"model": "gpt-4"}, "model")):
        x = httpx.post(server.url + "/v1/responses", json={"input": "x", **body}, timeout=30)
        assert x.status_code in (400, 404) and x.json()["error"]["param"] == param, x.text


def test_langchain_and_litellm_use_the_responses_api(server, monkeypatch):
    from langchain_openai import ChatOpenAI

    # (ignore_eos: a random model may draw its EOS within the counts asserted below)
    chat = ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", max_tokens=8,
                      max_retries=0, use_responses_api=True,
                      extra_body={"ignore_eos": True})
    msg = chat.invoke("hello")
    assert msg.text and msg.usage_metadata["output_tokens"] == 8
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    r = litellm.responses(model="openai/tiny", api_base=server.url + "/v1", api_key="x",
                          input="hello", max_output_tokens=16,  # (LiteLLM sends >= 16)
                          extra_body={"ignore_eos": True})
    assert r.usage.output_tokens == 16 and r.output[0].content[0].text


def test_the_server_logged_no_error(server):
    """Last: nothing above (max_tokens 0 has no first token, for one) hit a server bug."""
    assert "Traceback" not in server.log()


def test_min_tokens_over_the_token_limit_names_the_limit_not_the_context(server):
    # no max_tokens: the default 16, capped at the 4 tokens a 1020-token prompt leaves
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"prompt": [5] * 1020, "min_tokens": 10})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "min_tokens"
    assert err["message"].startswith("min_tokens (10) must be <= the 4 tokens this request "
                                     "may generate (its token limit, at most the room its "
                                     "prompt leaves in the context)")

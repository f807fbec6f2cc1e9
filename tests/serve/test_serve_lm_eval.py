"""lm-evaluation-harness against `phalanx serve` (issue 31): /v1/completions scores prompts (echo with
logprobs, max_tokens 0), takes every prompt form OpenAI's API takes (a string, strings, token ids, lists
of token ids) as one choice per prompt, and /tokenize, /detokenize and /tokenizer_info answer as vLLM's
do, so the harness's `local-completions` gives the same per-sample log-likelihoods, accuracy and
generations as its `hf` model on the HF export of the same weights.

First the endpoint itself over raw HTTP and the openai client, against the model's own log-softmax
computed here; then the harness (slow: each evaluation imports and runs lm-eval)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from serve_helpers import MODEL, InProcessServer

from phalanx.run.model_loader import load_model

PROMPT = "ROMEO: But soft, what light through yonder window breaks?"


@pytest.fixture(scope="module")
def reference(served_run):
    """The served run's model in this process: log-softmax over every position of a sequence."""
    loaded = load_model(served_run)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(loaded.model(torch.tensor([ids])).float()[0], dim=-1)

    log_softmax.bos, log_softmax.eos = loaded.specials.bos_id, loaded.specials.eos_id
    return log_softmax


def completion(http: httpx.Client, **body) -> dict:
    response = http.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def tokenize(http: httpx.Client, text: str, add_special_tokens: bool = False) -> list[int]:
    return http.post("/tokenize", json={"prompt": text, "add_special_tokens": add_special_tokens}).json()["tokens"]


def expected_scores(reference, model_input: list[int]) -> list[float]:
    """What the model gives each token of model_input after the first, given the ones before it."""
    logprobs = reference(model_input)
    return [float(logprobs[i, t]) for i, t in enumerate(model_input[1:])]


def close(got: list, want: list, tol: float = 1e-4) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= tol for a, b in zip(got, want))


# ---- echo with logprobs: the prompt's own tokens, scored ---------------------------------------------


def test_echo_logprobs_score_every_prompt_token_as_the_model_does(http, reference):
    ids = tokenize(http, PROMPT)
    body = completion(http, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = body["choices"][0]
    listed = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids) + 1, "completion_tokens": 0, "total_tokens": len(ids) + 1}
    # The prompt's tokens, not the BOS phalanx put before them; the first is scored given that BOS.
    assert len(listed["tokens"]) == len(ids) and "".join(listed["tokens"]) == PROMPT
    assert close(listed["token_logprobs"], expected_scores(reference, [reference.bos, *ids]))
    assert listed["text_offset"] == [sum(map(len, listed["tokens"][:i])) for i in range(len(ids))]
    for token, logprob, top, row in zip(
        listed["tokens"], listed["token_logprobs"], listed["top_logprobs"], reference([reference.bos, *ids])
    ):
        # OpenAI's legacy alternatives: the k likeliest, and the token itself.
        assert top[token] == logprob and len(top) <= 4
        assert abs(max(top.values()) - float(row.max())) < 1e-4

    # Token ids, as lm-evaluation-harness sends them: the same request, so the same scores.
    as_ids = completion(http, prompt=ids, echo=True, logprobs=3, max_tokens=0)["choices"][0]
    assert as_ids["logprobs"]["token_logprobs"] == listed["token_logprobs"] and as_ids["text"] == PROMPT
    # Ids that start with BOS get no second one, and the BOS is listed: the first token has no score.
    with_bos = completion(http, prompt=[reference.bos, *ids], echo=True, logprobs=0, max_tokens=0)["choices"][0]
    assert with_bos["logprobs"]["token_logprobs"] == [None, *listed["token_logprobs"]]
    assert with_bos["logprobs"]["top_logprobs"][0] is None and with_bos["logprobs"]["tokens"][0] == "<|begin_of_text|>"
    # add_special_tokens false (vLLM's field): exactly the ids given, no BOS before them.
    bare = completion(http, prompt=ids, echo=True, logprobs=0, max_tokens=0, add_special_tokens=False)["choices"][0]
    assert bare["logprobs"]["token_logprobs"][0] is None
    assert close(bare["logprobs"]["token_logprobs"][1:], expected_scores(reference, ids))


def test_harness_form_lists_the_prompt_then_the_one_generated_token(http, reference):
    """echo, logprobs 1, max_tokens 1 (what the harness sends): the prompt's entries, then the generated
    token's, which the harness drops as the last one."""
    ids = tokenize(http, PROMPT)
    listed = completion(http, prompt=[ids], echo=True, logprobs=1, max_tokens=1)["choices"][0]["logprobs"]
    assert len(listed["token_logprobs"]) == len(ids) + 1
    after_prompt = reference([reference.bos, *ids])[-1]
    assert abs(listed["token_logprobs"][-1] - float(after_prompt.max())) < 1e-4  # greedy: the likeliest


def test_a_long_prompt_is_scored_through_its_chunks_and_may_fill_the_context(http, reference):
    """1,023 ids and the BOS fill the 1,024-token context: scored (max_tokens 0, prefilled in chunks of
    256), never with room to generate."""
    ids = [3 + (i * 37) % 370 for i in range(1023)]
    listed = completion(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)["choices"][0]["logprobs"]
    assert close(listed["token_logprobs"], expected_scores(reference, [reference.bos, *ids]))
    refused = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 0})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    too_long = http.post(
        "/v1/completions", json={"model": MODEL, "prompt": [*ids, 5], "echo": True, "logprobs": 0, "max_tokens": 0}
    )
    assert too_long.status_code == 400 and "at most 1024 tokens" in too_long.json()["error"]["message"]


@pytest.mark.parametrize("batched", [True, False], ids=["batched-prefill", "one-prompt-a-pass"])
def test_the_engine_scores_prompts_on_either_prefill_path(served_run, reference, batched):
    """Without HTTP: prompts scored together in one batched pass, or one a pass (the path of a GPU, or
    wherever tall products are not row-invariant), short ones and one chunked, alone or beside others."""
    from phalanx.serve.core.options import SamplingOptions
    from phalanx.serve.engines.torch_engine import Engine

    loaded = load_model(served_run)
    engine = Engine(loaded.model, loaded.tokenizer, slots=4, max_queue=4)
    if not batched:  # as the engine runs where tall products are not row-invariant
        engine.batched_prefill, engine.prefill_budget = False, float("inf")
    engine.start()
    try:
        prompts = [[reference.bos, *[3 + (i * k) % 370 for i in range(n)]] for k, n in ((7, 4), (11, 30), (13, 300))]
        options = SamplingOptions(temperature=0, max_tokens=1)
        streams = [engine.submit(p, options, prompt_logprobs=2) for p in prompts]
        for prompt, stream in zip(prompts, streams):
            stream.text()
            scores = [e["logprob"] for e in stream.prompt_logprobs]
            assert stream.finish.completion_tokens == 1 and close(scores, expected_scores(reference, prompt))
            assert all(len(e["top_logprobs"]) == 2 for e in stream.prompt_logprobs)
    finally:
        engine.stop()


# ---- several prompts: several choices ---------------------------------------------------------------


def test_several_prompts_are_several_choices_each_as_if_alone(http):
    prompts = ["JULIET: O Romeo,", "MACBETH: Is this a dagger", "First Witch: When shall we"]
    alone = [completion(http, prompt=p, max_tokens=5, echo=True, logprobs=1)["choices"][0] for p in prompts]
    body = completion(http, prompt=prompts, max_tokens=5, n=2, echo=True, logprobs=1)
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, choice in enumerate(body["choices"]):  # prompt i // n, sample i % n; greedy samples are the same
        assert choice["text"] == alone[i // 2]["text"] and choice["logprobs"] == alone[i // 2]["logprobs"]
    ids = [tokenize(http, p) for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(len(i) + 1 for i in ids)
    as_ids = completion(http, prompt=ids, max_tokens=5, echo=True, logprobs=1)
    assert [c["text"] for c in as_ids["choices"]] == [a["text"] for a in alone]

    # Streamed: the choices interleave, each by its index, the prompt's scores in its first chunk.
    with http.stream(
        "POST",
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": prompts,
            "max_tokens": 5,
            "temperature": 0,
            "echo": True,
            "logprobs": 1,
            "stream": True,
        },
    ) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    texts, tokens = ["", "", ""], [[], [], []]
    for event in events:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["text"]
        tokens[choice["index"]] += (choice["logprobs"] or {}).get("tokens", [])
    assert texts == [a["text"] for a in alone] and tokens == [a["logprobs"]["tokens"] for a in alone]


def test_the_openai_client_sends_every_prompt_form(oai, http):
    ids = tokenize(http, PROMPT)
    forms = [PROMPT, [PROMPT], ids, [ids]]
    scores = [
        oai.completions.create(model=MODEL, prompt=form, echo=True, logprobs=1, max_tokens=0).choices[0].logprobs
        for form in forms
    ]
    assert all(s.token_logprobs == scores[0].token_logprobs and s.tokens == scores[0].tokens for s in scores)
    two = oai.completions.create(model=MODEL, prompt=[ids, ids[:5]], max_tokens=3, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]


# ---- the tokenizer endpoints ------------------------------------------------------------------------


def test_tokenizer_endpoints_round_trip_as_vllms_do(http, server, reference):
    info = http.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"], info["model_max_length"]) == (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        1024,
    )
    assert "ASSISTANT" in info["chat_template"]
    framed = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    ids = tokenize(http, PROMPT)
    assert framed["tokens"] == [reference.bos, *ids] and framed["count"] == len(ids) + 1
    assert framed["max_model_len"] == 1024 and framed["token_strs"][0] == "<|begin_of_text|>"
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    # A special token's string is that token here (the harness finds the BOS and EOS ids this way).
    assert tokenize(http, "<|end_of_text|>") == [reference.eos]
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    # Behind the API key like every other path.
    for method, path in (("GET", "/tokenizer_info"), ("POST", "/tokenize"), ("POST", "/detokenize")):
        response = httpx.request(method, f"{server.url}{path}", json={"prompt": "x", "tokens": [1]})
        assert response.status_code == 401 and "API key" in response.json()["error"]["message"]


# ---- refusals: one line each -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, says",
    [
        ("/v1/completions", {"prompt": []}, "invalid 'prompt': an empty list"),
        ("/v1/completions", {"prompt": [[]]}, "invalid 'prompt[0]': an empty list of token ids"),
        ("/v1/completions", {"prompt": [[5], []]}, "invalid 'prompt[1]': an empty list"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt[0] is a token id but prompt[1] is a string"),
        ("/v1/completions", {"prompt": [[1, 2], 3]}, "prompt[0] is a list of token ids but prompt[1] is an integer"),
        ("/v1/completions", {"prompt": [[["a"]]]}, "invalid 'prompt[0][0]': a list, not a token id"),
        ("/v1/completions", {"prompt": [[1, 2.5]]}, "invalid 'prompt[0][1]': a number"),
        ("/v1/completions", {"prompt": [True]}, "prompt[0] is a boolean"),
        ("/v1/completions", {"prompt": {"text": "x"}}, "not an object"),
        ("/v1/completions", {"prompt": None}, "not null"),
        (
            "/v1/completions",
            {"prompt": [384]},
            "invalid 'prompt[0]': token id 384 is not in the model's vocabulary (ids 0 to 383)",
        ),
        ("/v1/completions", {"prompt": [[1], [-1]]}, "invalid 'prompt[1][0]': token id -1"),
        ("/v1/completions", {"prompt": [2**70]}, "not in the model's vocabulary"),
        ("/v1/completions", {"prompt": ["x"] * 41}, "41 prompts x n=1, more than this server takes at once"),
        ("/v1/completions", {"prompt": ["x"] * 5, "n": 9}, "5 prompts x n=9"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, "'best_of' is not supported"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 6}, "logprobs must be an integer from 0 to 5"),
        ("/v1/completions", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "prompt": ""}, "'messages' is not supported"),
        ("/detokenize", {"tokens": [1, 1000]}, "invalid 'tokens[1]': token id 1000 is not"),
        ("/detokenize", {"tokens": ["a"]}, "tokens"),
    ],
)
def test_what_cannot_be_answered_is_a_400_in_one_line(http, path, body, says):
    response = http.post(path, json={"model": MODEL, **body} if path.startswith("/v1") else body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert says in message and "\n" not in message, message


def test_an_engine_that_cannot_score_refuses_echo_with_logprobs_and_the_end_token_is_listed(served_run, reference):
    """In a server of its own: an engine without prompt scoring (as llama.cpp's and vLLM's here) refuses
    echo with logprobs by name; and completions list the end-of-text token that ends a reply, since the
    harness drops the last entry as the generated token."""
    live_server = InProcessServer(served_run, slots=2, max_queue=2)
    with live_server as live, live.client() as http:
        ids = tokenize(http, PROMPT)
        greedy = int(reference([reference.bos, *ids])[-1].argmax())
        live_server.engine.scheduler.stop_ids = frozenset({greedy})  # the greedy first token now ends the reply
        ended = completion(http, prompt=ids, max_tokens=4, logprobs=0, echo=True)["choices"][0]
        assert ended["finish_reason"] == "stop" and ended["text"] == PROMPT
        assert len(ended["logprobs"]["tokens"]) == len(ids) + 1  # the prompt's, then the end token's

        live_server.engine.scores_prompts = False
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1})
        assert refused.status_code == 400 and "cannot compute" in refused.json()["error"]["message"]
        assert completion(http, prompt="x", echo=True, max_tokens=2)["choices"][0]["text"].startswith("x")


# ---- lm-evaluation-harness itself --------------------------------------------------------------------

HARNESS_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def harness_tasks(corpus, folder) -> None:
    """Two local tasks (no hub): 30 multiple-choice items (a line's first half; its own second half among
    three others'), and 5 generations from half-lines."""
    lines = [line.strip() for line in corpus.read_text().splitlines() if 30 < len(line.strip()) < 70]
    picked = random.Random(0).sample(lines, 65)
    halves = [
        (line[: line.rfind(" ", 0, len(line) // 2)], line[line.rfind(" ", 0, len(line) // 2) :]) for line in picked
    ]
    rng, items = random.Random(1), []
    for i, (context, ending) in enumerate(halves[:30]):
        choices = [ending] + [halves[30 + (i + k) % 30][1] for k in range(3)]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "answer": choices.index(ending)})
    generations = [{"context": line[: len(line) // 2]} for line in picked[60:]]  # cut mid-word, mostly
    for name, rows in (("mc", items), ("gen", generations)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = 'dataset_path: json\ntest_split: test\ndoc_to_text: "{{context}}"\n'
    (folder / "phalanx_mc.yaml").write_text(
        f"task: phalanx_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (folder / "phalanx_gen.yaml").write_text(
        f"task: phalanx_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_target: ""\n'
        'generation_kwargs:\n  until: ["@@"]\n  max_gen_toks: 12\n  do_sample: false\n  temperature: 0\n'
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )


@pytest.fixture(scope="module")
def harness(served_run, corpus, tmp_path_factory, server):
    """lm-eval, offline, on the two local tasks; evaluate(model, **kwargs) -> (accuracy, per-sample
    log-likelihoods, generations). The server's key reaches the harness as lm-eval reads it: the API
    requests' from OPENAI_API_KEY, the tokenizer probes' from auth_token."""
    folder = tmp_path_factory.mktemp("harness")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**HARNESS_ENV, "HF_DATASETS_CACHE": str(folder / "cache")}.items():
            env.setenv(name, value)
        env.setenv("OPENAI_API_KEY", server.api_key)
        import lm_eval
        from lm_eval.tasks import TaskManager

        harness_tasks(corpus, folder)
        tasks = TaskManager(include_path=str(folder))

        def evaluate(model, **kwargs):
            results = lm_eval.simple_evaluate(
                model=model, tasks=["phalanx_mc", "phalanx_gen"], task_manager=tasks, log_samples=True, **kwargs
            )
            samples = {name: sorted(results["samples"][name], key=lambda s: s["doc_id"]) for name in results["samples"]}
            lls = [[resp[0][0] for resp in s["resps"]] for s in samples["phalanx_mc"]]
            generations = [s["resps"][0][0] for s in samples["phalanx_gen"]]
            return results["results"]["phalanx_mc"]["acc,none"], lls, generations

        yield evaluate


@pytest.fixture(scope="module")
def hf_scores(harness, served_run, tmp_path_factory):
    """(a): lm-eval's own `hf` model (transformers) on the HF export of the served run."""
    from phalanx.export.hf import write_hf_export

    export = tmp_path_factory.mktemp("hf-export")
    write_hf_export(load_model(served_run), export)
    return harness("hf", model_args=f"pretrained={export},dtype=float32,device=cpu", batch_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("tokenized", [True, False], ids=["token-ids", "text"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_harness_through_phalanx_serve_agrees_with_its_hf_model(harness, hf_scores, server, tokenized, batch_size):
    """(b): `local-completions` against `phalanx serve` over loopback, the harness finding the server's
    tokenizer through /tokenizer_info and /tokenize: the same log-likelihood per choice (within 1e-3),
    the same accuracy, the same greedy generations."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model=MODEL,
        tokenized_requests=tokenized,
        batch_size=batch_size,
        max_length=1024,
        auth_token=server.api_key,
    )
    assert model.tokenizer_backend == "remote"  # found the endpoints (else it would need the model's files)
    accuracy, lls, generations = harness(model)
    hf_accuracy, hf_lls, hf_generations = hf_scores
    assert len(lls) == len(hf_lls) == 30 and all(len(choices) == 4 for choices in lls)
    worst = max(abs(a - b) for ours, theirs in zip(lls, hf_lls) for a, b in zip(ours, theirs))
    assert worst < 1e-3, f"log-likelihoods differ by up to {worst}"
    assert accuracy == hf_accuracy
    assert generations == hf_generations and all(generations)

"""LoRA adapters against PEFT: adapters saved by PEFT on a tiny random Llama give, through pagedllm, the greedy
tokens that PEFT's own model generates, batched with each other and with the base model; the prefix cache keeps
each adapter's blocks apart; max_loras holds the adapters of the running requests to its count."""

from __future__ import annotations

import argparse
import copy
import json
import re

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.lora.request import LoRARequest
from tests.models.tiny import hf_greedy

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [60, 61, 62, 63, 64], [200, 13, 9, 77, 150, 151, 40, 41, 42, 8]]
MAX_TOKENS = 12
# two adapters: every module at rank 8, and q/v only at rank 4 under rsLoRA
ADAPTERS = {
    "all": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.models.tiny import save_tiny_model

    folder, hf_model = save_tiny_model(tmp_path_factory.mktemp("lora") / "base", "llama-gqa", seed=11)
    return str(folder), hf_model


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory) -> dict[str, tuple[LoRARequest, list[list[int]]]]:
    """Each adapter's LoRARequest and PEFT's greedy tokens for PROMPTS; "base" for the model without one."""
    from peft import LoraConfig, get_peft_model

    result = {"base": (None, _hf_greedy(tiny[1]))}
    for lora_id, (name, options) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(lora_id)
        model = get_peft_model(copy.deepcopy(tiny[1]), LoraConfig(init_lora_weights=False, lora_dropout=0.0,
                                                                  **options))
        with torch.no_grad():      # updates the size of the base weights', so that they change the tokens
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 0.5)
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        model.save_pretrained(folder)
        result[name] = (LoRARequest(name, lora_id, str(folder)), _hf_greedy(model.eval()))
    return result


def _hf_greedy(model) -> list[list[int]]:
    return hf_greedy(model, PROMPTS, MAX_TOKENS)


def _llm(tiny, **kw) -> LLM:
    return LLM(model=tiny[0], dtype="float32", num_kv_blocks=256, block_size=4, enable_lora=True, **kw)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_adapters_and_the_base_model_in_one_batch_give_peft_tokens(tiny, adapters):
    llm = _llm(tiny, max_loras=2)
    names = ["base", "all", "qv"]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [adapters[name][0] for _ in PROMPTS for name in names]
    tokens = _tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False,
                                  lora_request=loras))
    for i, prompt_tokens in enumerate(tokens):
        name = names[i % len(names)]
        assert prompt_tokens == adapters[name][1][i // len(names)], (name, i)
    assert adapters["all"][1] != adapters["base"][1] and adapters["qv"][1] != adapters["base"][1]


def test_beam_search_runs_every_beam_with_the_adapter(tiny, adapters):
    """One beam is greedy decoding: PEFT's greedy tokens; the beams an adapter's search forks keep its adapter."""
    from pagedllm import BeamSearchParams

    llm = _llm(tiny, max_loras=2)
    one_beam = BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], one_beam,
                              lora_request=[adapters["all"][0], None, adapters["qv"][0]])
    assert [o.sequences[0].tokens[len(p):] for o, p in zip(outputs, PROMPTS)] == \
        [adapters["all"][1][0], adapters["base"][1][1], adapters["qv"][1][2]]
    engine = llm.engine
    engine.add_beam_search("wide", {"prompt_token_ids": PROMPTS[0]},
                           BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS, ignore_eos=True), adapters["all"][0])
    most_beams = 0
    while engine.has_unfinished_requests():
        engine.step()
        beams = list(engine.scheduler.running)
        most_beams = max(most_beams, len(beams))
        assert all(r.lora_request == adapters["all"][0] for r in beams)
        assert all(engine.runner.requests[r.request_id].lora == adapters["all"][0] for r in beams
                   if r.request_id in engine.runner.requests)
    assert most_beams == 3 and engine.pop_beam_search_output("wide") is not None


def test_max_loras_holds_the_running_adapters_to_its_count(tiny, adapters):
    llm = _llm(tiny, max_loras=1)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        for name in ("all", "qv", "base"):
            engine.add_request(f"{name}-{i}", {"prompt_token_ids": prompt}, GREEDY, lora_request=adapters[name][0])
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
        running = {r.lora_int_id for r in engine.scheduler.running if r.lora_request is not None}
        assert len(running) <= 1
    assert finished == {f"{name}-{i}": adapters[name][1][i] for i in range(len(PROMPTS))
                        for name in ("all", "qv", "base")}


def test_the_prefix_cache_keeps_each_adapters_blocks_apart(tiny, adapters):
    llm = _llm(tiny, max_loras=2)
    prompt = {"prompt_token_ids": PROMPTS[2]}
    first = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["all"][0])[0]
    other = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["qv"][0])[0]
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    again = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=adapters["all"][0])[0]
    assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (0, 0, 0)
    assert again.num_cached_tokens == 8          # two full blocks of 4 (the last token is always computed)
    assert _tokens([first, again]) == [adapters["all"][1][2]] * 2
    assert _tokens([other, base]) == [adapters["qv"][1][2], adapters["base"][1][2]]


def test_the_server_serves_each_adapter_by_name(tiny, adapters):
    """`--lora-modules`: /v1/models lists each adapter under its base; model=NAME runs it, on completions, chat and
    embeddings alike; an unknown name is a 404."""
    import httpx
    import openai

    from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args, lora_modules_from_args
    from tests.entrypoints.server_utils import start_server

    parser = add_server_args(argparse.ArgumentParser(), positional_model=False)
    args = parser.parse_args(["--model", tiny[0], "--enable-lora", "--max-loras", "2", "--lora-modules",
                              f"all={adapters['all'][0].lora_path}",
                              json.dumps({"name": "qv", "path": adapters["qv"][0].lora_path})])
    config = engine_config_from_args(args)
    assert (config.lora.max_loras, config.lora.max_lora_rank) == (2, 16)
    modules = lora_modules_from_args(args)
    assert [(m.lora_name, m.lora_int_id) for m in modules] == [("all", 1), ("qv", 2)]
    llm = _llm(tiny, max_loras=2)
    running = start_server(llm.engine, lora_modules=modules)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key=running.headers["Authorization"][7:])
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {running.model_name, "all", "qv"}
        assert (cards["qv"].parent, cards["qv"].root) == (running.model_name, adapters["qv"][0].lora_path)
        for name in ("base", "all", "qv"):
            model = running.model_name if name == "base" else name
            reply = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                              extra_body={"ignore_eos": True, "return_token_ids": True})
            assert reply.choices[0].token_ids == adapters[name][1][1], name
        # vLLM's lora_requests_info: a series per set of adapters seen, stamped with when it was last seen
        metrics = httpx.get(f"{running.base_url}/metrics", headers=running.headers).text
        seen = re.findall(r'pagedllm:lora_requests_info\{[^}]*max_lora="2",[^}]*running_lora_adapters="([^"]*)"',
                          metrics)
        assert {"all", "qv", ""} <= set(seen), metrics
        vectors = [client.embeddings.create(model=m, input=PROMPTS[0]).data[0].embedding for m in ("all", "qv")]
        assert vectors[0] != vectors[1]
        missing = httpx.post(f"{running.base_url}/v1/completions", headers=running.headers,
                             json={"model": "nope", "prompt": "hi", "max_tokens": 1})
        assert missing.status_code == 404 and "all, qv" in missing.json()["error"]["message"]
    finally:
        running.stop()
    with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
        engine_config_from_args(parser.parse_args(["--lora-modules", "a=/x"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--lora-modules", "no-path"])


def test_adapters_load_and_unload_while_the_server_runs(tiny, adapters, monkeypatch, tmp_path):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, under VLLM_ALLOW_RUNTIME_LORA_UPDATING=true; absent
    (404) without it."""
    import httpx

    from tests.entrypoints.server_utils import start_server

    llm = _llm(tiny, max_loras=2)
    running = start_server(llm.engine)
    try:
        assert httpx.post(f"{running.base_url}/v1/load_lora_adapter", headers=running.headers,
                          json={"lora_name": "qv", "lora_path": "/x"}).status_code == 404
    finally:
        running.stop()
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    running = start_server(_llm(tiny, max_loras=2).engine)
    try:
        def post(path: str, **body) -> httpx.Response:
            return httpx.post(f"{running.base_url}/v1/{path}", headers=running.headers, json=body, timeout=60)

        def complete(model: str) -> httpx.Response:
            return post("completions", model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                        ignore_eos=True, return_token_ids=True)

        assert complete("qv").status_code == 404
        loaded = post("load_lora_adapter", lora_name="qv", lora_path=adapters["qv"][0].lora_path)
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'qv' added successfully."
        assert "qv" in {m["id"] for m in httpx.get(f"{running.base_url}/v1/models", headers=running.headers)
                        .json()["data"]}
        assert complete("qv").json()["choices"][0]["token_ids"] == adapters["qv"][1][1]
        again = post("load_lora_adapter", lora_name="qv", lora_path=adapters["qv"][0].lora_path)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        broken = post("load_lora_adapter", lora_name="broken", lora_path=str(tmp_path))
        assert broken.status_code == 400 and "adapter_config.json not found" in broken.json()["error"]["message"]
        assert complete("broken").status_code == 404
        unloaded = post("unload_lora_adapter", lora_name="qv")
        assert unloaded.status_code == 200 and complete("qv").status_code == 404
        assert post("unload_lora_adapter", lora_name="qv").status_code == 404
        assert complete(running.model_name).json()["choices"][0]["token_ids"] == adapters["base"][1][1]
    finally:
        running.stop()


def test_lora_requests_are_checked_with_clear_errors(tiny, adapters, tmp_path):
    request = adapters["all"][0]
    plain = LLM(model=tiny[0], dtype="float32", num_kv_blocks=64)
    with pytest.raises(ValueError, match="LoRA is off: start the engine with enable_lora=True"):
        plain.generate([1, 2, 3], GREEDY, lora_request=request)
    llm = _llm(tiny, max_lora_rank=4)
    with pytest.raises(ValueError, match="has rank 8, over max_lora_rank=4"):
        llm.generate([1, 2, 3], GREEDY, lora_request=request)
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("missing", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="must be a LoRARequest or None"):
        llm.generate([1, 2, 3], GREEDY, lora_request="all")
    with pytest.raises(ValueError, match="lora_request has 1 entries for 2 prompts"):
        llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[request])
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True is not supported"):
        llm.generate([1, 2, 3], GREEDY, lora_request=LoRARequest("dora", 10, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("zero", 0, str(tmp_path))
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(model=tiny[0], enable_lora=True, tensor_parallel_size=2)
    # what failed loaded nothing and queued nothing: the engine still serves
    assert _tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)) == \
        [adapters["base"][1][0]]


def test_an_adapter_on_granite_scales_its_branch_updates_as_the_model(tmp_path):
    """Granite's residual multiplier, folded into o_proj's and down_proj's weights, scales their adapters' updates
    too: PEFT's tokens."""
    from peft import LoraConfig, get_peft_model

    from tests.models.tiny import save_tiny_model

    folder, hf_model = save_tiny_model(tmp_path / "granite", "granite", seed=4, tie_word_embeddings=False)
    torch.manual_seed(5)
    model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, lora_dropout=0.0, r=4,
                                                               target_modules=["o_proj", "down_proj"]))
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:
                param.normal_(0, 2.0)
    model.save_pretrained(tmp_path / "adapter")
    expected = _hf_greedy(model.eval())
    assert expected != _hf_greedy(hf_model)
    llm = _llm((str(folder), hf_model))
    tokens = _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                                  lora_request=LoRARequest("g", 1, str(tmp_path / "adapter"))))
    assert tokens == expected


def test_an_adapter_on_phis_attention_gives_pefts_tokens_and_one_on_its_ungated_mlp_is_refused(tmp_path):
    """Phi's layers run as modules (LayerNorms, parallel branches): an adapter on its q/k/v_proj gives PEFT's tokens;
    one on its ungated MLP's fc1 names a module the engine's LoRA layers do not take, and is refused saying so."""
    from peft import LoraConfig, get_peft_model

    from tests.models.tiny import save_tiny_model

    folder, hf_model = save_tiny_model(tmp_path / "phi", "phi", seed=6)
    llm = _llm((str(folder), hf_model))
    for name, modules in (("qkv", ["q_proj", "k_proj", "v_proj"]), ("fc1", ["fc1"])):
        torch.manual_seed(7)
        model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(init_lora_weights=False, lora_dropout=0.0, r=4,
                                                                   target_modules=modules))
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.normal_(0, 2.0)
        model.save_pretrained(tmp_path / name)
        request = LoRARequest(name, 1 if name == "qkv" else 2, str(tmp_path / name))
        if name == "fc1":
            with pytest.raises(ValueError, match="targets nothing this model's LoRA layers take"):
                llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=request)
            continue
        expected = _hf_greedy(model.eval())
        assert expected != _hf_greedy(hf_model)
        assert _tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False,
                                    lora_request=request)) == expected


def test_adapters_are_added_listed_and_removed_by_vllms_engine_calls(tiny, adapters):
    """vLLM's LLMEngine.add_lora / list_loras / remove_lora, and AsyncLLM's: an adapter added ahead runs its
    requests; one removed loads again from its folder when a request names it."""
    import asyncio

    from pagedllm import AsyncEngineArgs, AsyncLLM

    engine = _llm(tiny, max_loras=2, max_cpu_loras=2).llm_engine
    lora = adapters["all"][0]
    assert engine.list_loras() == set() and engine.add_lora(lora) and engine.list_loras() == {lora.lora_int_id}
    assert engine.remove_lora(lora.lora_int_id) and not engine.remove_lora(lora.lora_int_id)
    assert engine.list_loras() == set()
    engine.add_request("again", {"prompt_token_ids": PROMPTS[0]}, GREEDY, lora_request=lora)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert finished[0].outputs[0].token_ids == adapters["all"][1][0] and engine.list_loras() == {lora.lora_int_id}

    async def run() -> None:
        served = AsyncLLM.from_engine_args(AsyncEngineArgs(tiny[0], dtype="float32", num_kv_blocks=64,
                                                           enable_lora=True))
        try:
            assert await served.add_lora(lora) and await served.list_loras() == {lora.lora_int_id}
            outputs = [o async for o in served.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, "r",
                                                        lora_request=lora)]
            assert outputs[-1].outputs[0].token_ids == adapters["all"][1][0]
            assert await served.remove_lora(lora.lora_int_id) and await served.list_loras() == set()
        finally:
            served.shutdown()
    asyncio.run(run())
    plain = LLM(model=tiny[0], dtype="float32", num_kv_blocks=64).llm_engine      # LoRA off: refused, saying how
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.add_lora(lora)
    assert plain.list_loras() == set() and not plain.remove_lora(lora.lora_int_id)

"""The engine end to end on the CPU: extkv greedy equals transformers, legacy equals
extensible, preemption and chunked prefill change nothing, bad input is refused."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from extkv import LLM, SamplingParams
from extkv.demo import make_random_checkpoint
from extkv.engine.config import EngineConfig
from extkv.engine.model_runner import profile_lengths
from helpers import extkv_tokens, hf_greedy

SMALL = dict(cpu_memory_budget_bytes=256 << 20, max_model_len=256, max_num_batched_tokens=512)
PROMPTS = [[5, 6, 7, 8, 9, 100, 200], [17] * 3, list(range(30, 71)), [250, 3]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("llama"), "llama", tie_word_embeddings=False, with_tokenizer=False
    )


GREEDY = SamplingParams(temperature=0, max_tokens=24)
NO_EOS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("backend", ["split", "block_major"])
@pytest.mark.parametrize("extensible", [False, True])
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_matches_transformers(arch: str, extensible: bool, backend: str, request) -> None:
    path = request.getfixturevalue(arch)
    expected = hf_greedy(path, PROMPTS, GREEDY.max_tokens)
    llm = LLM(path, enable_extensible_kv_cache=extensible, kv_layout=backend, **SMALL)
    assert extkv_tokens(llm, PROMPTS, GREEDY) == expected
    assert len({tuple(t) for t in expected}) > 1  # the model does not babble one token


def test_legacy_and_extensible_agree_and_extensible_logs_its_flow(
    qwen3: Path, caplog: pytest.LogCaptureFixture
) -> None:
    legacy = LLM(qwen3, **SMALL)
    with caplog.at_level(logging.INFO, logger="extkv"):
        extensible = LLM(qwen3, enable_extensible_kv_cache=True, **SMALL)
    messages = [r.getMessage() for r in caplog.records]
    reserve = next(i for i, m in enumerate(messages) if m.startswith("Reserved address space"))
    extend = next(i for i, m in enumerate(messages) if m.startswith("Extended KV cache to "))
    assert reserve < extend
    report = extensible.memory_report()
    assert messages[extend].startswith(f"Extended KV cache to {report['num_blocks']} blocks. ")
    assert "GiB committed (+" in messages[extend] and messages[extend].endswith(" s.")
    assert report["extensible"] and not legacy.memory_report()["extensible"]
    assert report["kv_cache_bytes"] >= report["num_blocks"] * report["bytes_per_block"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert extkv_tokens(legacy, PROMPTS, params) == extkv_tokens(extensible, PROMPTS, params)


def test_start_up_logs_each_phase_with_its_time(
    qwen3: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture
) -> None:
    """Start-up on the CPU is no silence: load, profile, capture and sizing each say when
    they begin or end, and how long they took (the figures of the memory report); a bar
    shows the weights loading."""
    with caplog.at_level(logging.INFO, logger="extkv"):
        llm = LLM(qwen3, enable_extensible_kv_cache=True, **SMALL)
    report = llm.memory_report()
    messages = [r.getMessage() for r in caplog.records]

    def index(prefix: str) -> int:
        return next(i for i, m in enumerate(messages) if m.startswith(prefix))

    phases = [
        index(f"Loading {qwen3} (torch.float32) on cpu."),
        index(f"Loaded the weights in {report['load_seconds']:.2f} s."),
        index("Profiling memory: one step of 512 tokens over "),  # max_num_batched_tokens
        index(f"Memory profile took {report['profile_seconds']:.2f} s: "),
        index("Capturing the decode graphs (the CPU: warm-ups only)."),
        index(f"Capture took {report['capture_seconds']:.2f} s; "),
        index(f"KV cache setup took {report['kv_setup_seconds']:.2f} s "),
    ]
    assert phases == sorted(phases)
    sizing = messages[phases[-1]]
    assert f"extend {report['extend_seconds']:.2f} s): {report['num_blocks']} blocks." in sizing
    with safe_open(qwen3 / "model.safetensors", framework="pt") as checkpoint:
        tensors = len(checkpoint.keys())  # every one of them loaded
    assert f"Loading weights: 100%|██████████| {tensors}/{tensors} " in capsys.readouterr().err


@pytest.mark.parametrize("chunk", [None, 1, 2, 3])
def test_the_profile_cuts_the_most_chunks_a_step_can(chunk: int | None) -> None:
    """Every way to spread `total` tokens over the sequences (each 1..max_len): the
    profile's spread cuts the most Mamba chunks of any, at the longest chunk length a
    step can have; without Mamba layers it is the even one."""
    for total, num_seqs, max_len in itertools.product(range(1, 10), range(1, 4), range(1, 7)):
        if not num_seqs <= total <= num_seqs * max_len:
            continue
        lengths = profile_lengths(total, num_seqs, max_len, chunk)
        assert sum(lengths) == total and len(lengths) == num_seqs
        assert all(1 <= n <= max_len for n in lengths)
        if chunk is None:
            assert max(lengths) - min(lengths) <= 1
            continue
        spreads = [
            spread
            for spread in itertools.product(range(1, max_len + 1), repeat=num_seqs)
            if sum(spread) == total
        ]
        cut = lambda spread: sum(-(-n // chunk) for n in spread)  # noqa: E731
        assert cut(lengths) == max(map(cut, spreads))
        assert max(lengths) == max(max(s) for s in spreads if cut(s) == cut(lengths))


def test_cpu_steps_default_to_2048_tokens(qwen3: Path) -> None:
    """The CPU's start-up profile runs one step of max_num_batched_tokens: 2048 there, not
    CUDA's 8192 (which only made the CPU's start-up slower); more sequences raise it."""
    for max_num_seqs, step in [(4, 2048), (4096, 4096)]:
        config = EngineConfig(model=str(qwen3), device="cpu", max_num_seqs=max_num_seqs)
        config.finalize(256)
        assert config.max_num_batched_tokens == step


@pytest.mark.parametrize("extensible", [False, True])
def test_memory_report_fields(qwen3: Path, extensible: bool) -> None:
    """The report's figures follow from the model, the options and the sizing rules (on
    the CPU: no graphs, no margin, the whole budget less weights and activations)."""
    llm = LLM(qwen3, enable_extensible_kv_cache=extensible, block_size=32, **SMALL)
    report = llm.memory_report()
    assert report["extensible"] is extensible and report["block_size"] == 32
    counts = [k for k in report if k.endswith("_bytes") or k.startswith("num_blocks")]
    counts.remove("graph_pool_estimate_bytes")  # None where nothing was estimated
    assert all(type(report[k]) is int for k in counts), {k: report[k] for k in counts}
    hf = json.loads((qwen3 / "config.json").read_text())
    kv_heads, head_dim, layers = (
        hf["num_key_value_heads"],
        hf["head_dim"],
        hf["num_hidden_layers"],
    )
    per_block = report["bytes_per_block"]
    assert per_block == 2 * 32 * kv_heads * head_dim * 4 * layers  # K and V, fp32
    assert report["weights_bytes"] >= sum(
        p.numel() * p.element_size() for p in llm.engine.runner.model.parameters()
    )
    budget = SMALL["cpu_memory_budget_bytes"]
    available = report["available_bytes"]
    assert available == budget - report["weights_bytes"] - report["activation_peak_bytes"] > 0
    assert (report["graph_pool_bytes"], report["graph_pool_bytes_per_rank"]) == (0, [0])
    assert report["margin_bytes"] == 0
    blocks = report["num_blocks"]
    assert blocks == report["num_blocks_committed"] == llm.engine.block_manager.num_blocks
    assert sum(report["kv_bytes_by_kind"].values()) == report["kv_cache_bytes"]
    if extensible:
        # Reserved for all `available` could hold; committed what is left after graphs,
        # in whole granules.
        assert report["graph_pool_estimate_bytes"] is None
        assert report["num_blocks_capacity"] == available // per_block
        assert 0 < blocks <= report["num_blocks_capacity"]
        assert blocks * per_block <= report["kv_cache_bytes"] <= report["kv_reserved_bytes"]
        assert report["kv_reserved_bytes"] >= report["num_blocks_capacity"] * per_block
    else:
        assert report["graph_pool_estimate_bytes"] == 0  # what the legacy path guessed
        assert blocks == report["num_blocks_capacity"] == available // per_block
        assert report["kv_cache_bytes"] == report["kv_reserved_bytes"] == blocks * per_block
    seconds = {k: v for k, v in report.items() if k.endswith("_seconds")}
    assert all(isinstance(v, float) and v >= 0 for v in seconds.values()), seconds
    parts = seconds["profile_seconds"] + seconds["capture_seconds"] + seconds["extend_seconds"]
    assert seconds["kv_setup_seconds"] >= parts
    assert seconds["startup_seconds"] >= seconds["load_seconds"] + seconds["kv_setup_seconds"]
    assert (seconds["extend_seconds"] > 0) == extensible


@pytest.mark.parametrize("extensible", [False, True])
def test_preemption_keeps_outputs(qwen3: Path, extensible: bool) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [list(range(10 + i, 40 + i)) for i in range(6)]
    roomy = LLM(qwen3, **SMALL)
    expected = extkv_tokens(roomy, prompts, params)
    # 16 blocks of 16 tokens; each sequence grows to 70 tokens (5 blocks): 6 cannot fit.
    tight = LLM(qwen3, num_gpu_blocks_override=16, enable_extensible_kv_cache=extensible, **SMALL)
    assert extkv_tokens(tight, prompts, params) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    assert tight.engine.block_manager.num_used_blocks == 0  # everything given back


def test_chunked_prefill_keeps_outputs(qwen3: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(1, 120)), list(range(200, 260)), [7, 8]]
    expected = extkv_tokens(LLM(qwen3, **SMALL), prompts, params)
    chunked = LLM(qwen3, **{**SMALL, "max_num_batched_tokens": 32, "max_num_seqs": 4})
    assert extkv_tokens(chunked, prompts, params) == expected


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunks_wait_for_room_instead_of_starving_decodes(
    qwen3: Path, async_scheduling: bool
) -> None:
    """5 blocks of 16 tokens, 8-token chunks: a prompt chunk that finds no free block
    waits (preempting itself would recompute the same chunks forever while the
    prefill-first scheduler never ran the decodes that free blocks)."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [list(range(10 + 3 * i, 40 + 3 * i)) for i in range(6)]
    options = {**SMALL, "max_model_len": 48, "max_num_seqs": 8, "max_num_batched_tokens": 8}
    expected = extkv_tokens(LLM(qwen3, **options), prompts, params)
    tight = LLM(qwen3, num_gpu_blocks_override=5, async_scheduling=async_scheduling, **options)
    engine = tight.engine
    ids = [engine.add_request(p, params) for p in prompts]
    tokens = {}
    for _ in range(1000):  # a bound, so a livelock fails instead of hanging
        if not engine.has_unfinished_requests():
            break
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step(finished_only=True)}
    assert not engine.has_unfinished_requests(), "no progress within 1000 steps"
    assert [tokens[i] for i in ids] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_eos_stops_and_text_is_decoded(qwen3: Path, tmp_path: Path) -> None:
    """Make the 4th greedy token of a prompt the checkpoint's EOS: generation stops there
    unless ignore_eos, its text left out; stop_token_ids do the same per request."""
    prompt = PROMPTS[0]
    free_run = extkv_tokens(LLM(qwen3, **SMALL), [prompt], NO_EOS)[0]
    eos = free_run[3]
    assert eos not in free_run[:3]
    folder = tmp_path / "eos"
    shutil.copytree(qwen3, folder)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(config))
    llm = LLM(folder, **SMALL)
    out = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (free_run[:4], "stop")
    # As vLLM's: the stop token's text stays out unless include_stop_str_in_output.
    decode = llm.get_tokenizer().decode
    assert out.text == decode(out.token_ids[:-1], skip_special_tokens=True)
    included = SamplingParams(temperature=0, max_tokens=24, include_stop_str_in_output=True)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=included, use_tqdm=False)
    assert out[0].outputs[0].text == decode(free_run[:4], skip_special_tokens=True)
    assert decode(free_run[:4]) != decode(free_run[:3])
    assert extkv_tokens(llm, [prompt], NO_EOS)[0] == free_run
    i = next(i for i in range(4, 24) if free_run[i] not in free_run[:i])
    by_request = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[free_run[i]])
    stopped = LLM(qwen3, **SMALL).generate(
        prompt_token_ids=[prompt], sampling_params=by_request, use_tqdm=False
    )
    assert stopped[0].outputs[0].token_ids == free_run[: i + 1]
    assert stopped[0].outputs[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=50, max_tokens=20, seed=123, ignore_eos=True
    )
    alone = extkv_tokens(llm, [PROMPTS[0]], params)[0]
    in_batch = extkv_tokens(llm, [PROMPTS[1], PROMPTS[0], PROMPTS[2]], [params] * 3)
    assert in_batch[1] == alone
    other = SamplingParams(temperature=0.9, max_tokens=20, seed=124, ignore_eos=True)
    assert extkv_tokens(llm, [PROMPTS[0]], other)[0] != alone
    assert extkv_tokens(LLM(qwen3, **SMALL), [PROMPTS[0]], params)[0] == alone


def test_top_k_one_is_greedy(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL)
    sampled = SamplingParams(temperature=1.5, top_k=1, max_tokens=16, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert extkv_tokens(llm, PROMPTS, sampled) == extkv_tokens(llm, PROMPTS, greedy)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k must be an int in \\[-1, 2\\*\\*63\\)"),
        ({"top_k": 2**63}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**64}, "seed must be an int in \\[0, 2\\*\\*63\\)"),
        ({"seed": -1}, "seed must be an int in"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"enable_extensible_kv_cache": True, "kv_cache_memory_bytes": 1 << 20},
            "kv_cache_memory_bytes",
        ),
        ({"enable_extensible_kv_cache": "yes"}, "enable_extensible_kv_cache"),
        ({"kv_layout": "flash"}, "kv_layout must be one of 'split', 'block_major'"),
        ({"attention_backend": "flash"}, "attention_backend must be one of"),
        ({"device": "tpu"}, "device must be"),
        ({"dtype": "int8"}, "dtype must be one of"),
        ({"block_size": 7}, "block_size must be one of"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 100_000}, "max_position_embeddings"),
        ({"num_gpu_blocks_override": -1}, "num_gpu_blocks_override"),
    ],
)
def test_bad_engine_options(qwen3: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(qwen3, **{**SMALL, **kwargs})


def test_unknown_option_lists_the_options(qwen3: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown option\(s\) max_num_seq;.*max_num_seqs"):
        LLM(qwen3, max_num_seq=4)


def test_attention_backend_is_a_deprecated_alias_of_kv_layout(qwen3: Path) -> None:
    with pytest.warns(DeprecationWarning, match="use kv_layout"):
        config = EngineConfig(model=str(qwen3), attention_backend="block_major")
    assert config.kv_layout == "block_major" and config.attention_backend is None


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"checkpoint folder.*\.gguf file or a Hugging Face hub id"
    ):
        LLM(tmp_path / "nothing-here")


@pytest.mark.parametrize("extensible", [False, True])
def test_kv_cache_too_small_says_what_is_missing(qwen3: Path, extensible: bool) -> None:
    with pytest.raises(RuntimeError, match=r"needs 16.*GiB \(\d+ bytes\) of memory are missing"):
        LLM(qwen3, num_gpu_blocks_override=3, enable_extensible_kv_cache=extensible, **SMALL)
    with pytest.raises(RuntimeError, match="missing"):
        LLM(
            qwen3,
            enable_extensible_kv_cache=extensible,
            **{**SMALL, "cpu_memory_budget_bytes": 400_000},
        )


def test_bad_prompts(qwen3: Path) -> None:
    llm = LLM(qwen3, **SMALL)
    with pytest.raises(ValueError, match="empty"):
        llm.generate(prompt_token_ids=[[]], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2, 384]], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[1, -2]], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[1] * 256], use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate(use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries"):
        llm.generate(prompt_token_ids=[[1]], sampling_params=[GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):  # the good first prompt is not kept
        llm.generate(prompt_token_ids=[[1, 2, 3], []], use_tqdm=False)
    # Nothing was queued by the failed calls: the engine still serves.
    assert not llm.engine.has_unfinished_requests()
    assert len(extkv_tokens(llm, [[1, 2]], GREEDY)[0]) > 0


def test_text_prompts_need_a_tokenizer(llama: Path) -> None:
    llm = LLM(llama, **SMALL)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    stop = SamplingParams(stop="x")
    with pytest.raises(ValueError, match=r"stop strings need a tokenizer.*use stop_token_ids"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=stop, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_static_decode_path_equals_eager(qwen3: Path) -> None:
    """The graph path's staging and padding (run eagerly on the CPU) change nothing:
    5 sequences run padded to a batch of 8, with sampled and greedy rows mixed."""
    prompts = [*PROMPTS, [9, 8, 7]]
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=0.8, max_tokens=20, seed=7, ignore_eos=True)
    params = [greedy, seeded, greedy, seeded, greedy]
    static = LLM(qwen3, max_num_seqs=20, **SMALL)
    assert static.engine.runner.graphs is not None
    assert static.engine.runner.graphs.batch_sizes == [1, 2, 4, 8, 16, 20]
    eager = LLM(qwen3, max_num_seqs=20, enforce_eager=True, **SMALL)
    assert eager.engine.runner.graphs is None
    assert extkv_tokens(static, prompts, params) == extkv_tokens(eager, prompts, params)

"""In-process unit tests: request validation, stream deltas, metrics text, the CLI flags."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from paged_server.errors import APIError
from paged_server.metrics import Metrics
from paged_server.openai_protocol import check_context, parse_chat, parse_completion
from paged_server.openai_responses import StreamChoice

sys.path.insert(0, str(Path(__file__).parent))
from fake_engine import FakeEngine


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
        ({"prompt": "x", "logprobs": -2}, "logprobs"),
        ({"prompt": "x", "stop": [1]}, "stop"),
        ({"prompt": "x", "logit_bias": [1, 5]}, "logit_bias"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "use_beam_search": True}, "use_beam_search"),
        ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "x", "temperature": float("nan")}, "temperature"),
    ],
)
def test_completion_validation_names_the_parameter(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_completion_parse() -> None:
    req = parse_completion(
        {
            "prompt": [[1, 2], [3]],
            "n": 2,
            "stop": "x",
            "user": "me",
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.prompts == [[1, 2], [3]] and req.max_tokens == 16 and req.n == 2
    assert req.include_usage and req.sampling["stop"] == ["x"]
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]


def test_chat_validation() -> None:
    req = parse_chat(
        {
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}]}],
            "max_completion_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert req.messages == [{"role": "system", "content": "a"}]
    assert req.max_tokens == 3 and req.logprobs == 2
    for body, param in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": []}, "tools"),  # (as vLLM)
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools[0]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json"}},
            "response_format",
        ),
    ]:
        with pytest.raises(APIError) as e:
            parse_chat(body)
        assert e.value.param == param


def test_context_check_message_gives_both_lengths() -> None:
    assert check_context(10, None, 128) == 118
    with pytest.raises(APIError) as e:
        check_context(200, 16, 128)
    assert "128" in e.value.message and "200" in e.value.message
    with pytest.raises(APIError) as e:
        check_context(100, 50, 128)
    assert e.value.param == "max_tokens" and "150" in e.value.message


def _delta(text: str, token_ids: list[int], finish: str | None = None) -> SimpleNamespace:
    lps = [{t: SimpleNamespace(logprob=-1.0, rank=1, decoded_token=None)} for t in token_ids]
    return SimpleNamespace(
        index=0,
        text=text,
        token_ids=token_ids,
        logprobs=lps,
        finish_reason=finish,
        stop_reason=None,
    )


def test_stream_choice_merges_deltas_a_slow_reader_missed() -> None:
    st = StreamChoice()
    assert st.add(_delta("He", [1]), False) and st.add(_delta("llo", [2, 3]), False)
    c = st.chunk(4, "echo: ", 0, str, chat=False)
    assert c["index"] == 4 and c["text"] == "echo: Hello" and c["finish_reason"] is None
    assert c["logprobs"]["tokens"] == ["1", "2", "3"] and c["logprobs"]["text_offset"] == [6, 7, 8]
    assert st.chunk(4, "", 0, str, chat=False) is None  # nothing new
    st.add(_delta(" you", [4]), False)
    st.add(_delta("", [], "stop"), True)
    c = st.chunk(4, "", 0, str, chat=True)
    assert c["delta"] == {"content": " you"} and c["finish_reason"] == "stop"
    assert c["logprobs"]["content"][0]["token"] == "4"
    assert st.sent_chars == len("echo: Hello you")  # text_offset counts the echo too
    assert not st.add(_delta("", [], "stop"), True)  # finished: later outputs repeat it


def test_metrics_render_prometheus_text() -> None:
    m = Metrics("tiny")
    m.ttft.observe(0.03)
    m.ttft.observe(50.0)
    stats = FakeEngine().get_stats()
    text = m.render(stats)
    # vLLM's labels, in prometheus_client's (sorted) order
    assert 'paged:num_requests_running{engine="0",model_name="tiny"} 0' in text
    ttft = "paged:time_to_first_token_seconds_bucket"
    assert f'{ttft}{{engine="0",le="0.04",model_name="tiny"}} 1' in text
    assert f'{ttft}{{engine="0",le="+Inf",model_name="tiny"}} 2' in text
    assert "# TYPE paged:prompt_tokens_total counter" in text


def test_metrics_prefix_renames_every_metric() -> None:
    """--metrics-prefix vllm: vLLM's own names (dashboards and autoscalers written for vLLM),
    the same exposition otherwise; label values keep what they hold; a prefix that is no
    Prometheus name is refused."""
    from paged_server.cli_args import build_parser

    prefix = build_parser().parse_args(["--metrics-prefix", "vllm"]).metrics_prefix

    def render(model: str, *args: str) -> str:
        m = Metrics(model, *args)
        m.ttft.observe(0.03)
        m.count_http("/v1/completions", 200)
        return m.render(FakeEngine().get_stats())

    text = render("tiny", prefix)
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(samples) > 20 and all(line.startswith("vllm:") for line in samples)
    assert "# TYPE vllm:time_to_first_token_seconds histogram" in text
    assert text == render("tiny").replace("paged:", "vllm:")
    waiting = 'vllm:num_requests_waiting{engine="0",model_name="paged:m"} 0'
    assert waiting in render("paged:m", prefix)
    for bad in ("vllm:", "1x", "a-b", ""):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--metrics-prefix", bad])


def test_cli_takes_vllm_flag_names() -> None:
    from paged_server.cli_args import build_parser

    argv = (
        "--model m --served-model-name a b --port 0 --api-key k --tensor-parallel-size 2 "
        "--dtype float16 --max-model-len 64 --gpu-memory-utilization 0.5 --block-size 32 "
        "--max-num-seqs 8 --max-num-batched-tokens 512 --no-enable-prefix-caching --seed 3 "
        "--chat-template t.jinja --max-queued-requests 4 --load-format dummy --enforce-eager"
    )
    args = build_parser().parse_args(argv.split(" "))
    assert args.served_model_name == ["a", "b"] and args.tensor_parallel_size == 2
    assert args.enable_prefix_caching is False and args.enforce_eager
    defaults = build_parser().parse_args([])
    assert (defaults.host, defaults.port, defaults.model) == ("127.0.0.1", 8000, None)
    assert defaults.enable_prefix_caching and defaults.max_queued_requests is None


def test_server_modules_never_import_torch() -> None:
    import subprocess

    code = "import sys, paged_server.cli, paged_server.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

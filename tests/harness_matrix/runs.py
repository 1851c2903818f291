"""How each real harness is run against one tracetap episode: its command, env and config.

Every run starts from an empty environment (nothing of the caller's, so no real API key
or proxy setting leaks in) with HOME in the run's own directory, a dummy key, the
episode's base URL, telemetry and update checks off, and tools approved without a prompt
(the suite runs as root, where Claude Code refuses --dangerously-skip-permissions: its
Read tool is allowed by name and the rest are refused without a prompt in -p mode).

The mock engine calls the first tool a harness offers, with arguments drawn from its
schema. For Claude Code and Qwen Code that is the sub-agent tool, and a sub-agent of a
random type, sometimes in the background, makes the episode's calls differ from run to
run (seen with Claude Code: a background sub-agent's extra calls in the episode); that
tool is removed (--disallowedTools Agent, permissions.deny), so the first tool is an
ordinary one. docs/harnesses.md lists these settings for users.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASK = "Read notes.txt and tell me the answer it holds."
NOTES = "The answer is 42.\n"
MODEL = "mock-model"
CLOSED_PORT = "http://127.0.0.1:9/"  # discard: nothing listens, a fetch fails at once


def install_dir() -> Path:
    """Where install.sh put the pinned set (same key: the hash of versions.txt)."""
    root = Path(os.environ.get("TRACETAP_HARNESSES") or Path.home() / ".cache/tracetap-harnesses")
    return root / hashlib.sha256((HERE / "versions.txt").read_bytes()).hexdigest()[:16]


def pinned() -> dict[str, str]:
    """Package name → pinned version, from versions.txt."""
    out = {}
    for line in (HERE / "versions.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            _, name, version = line.split()[:3]
            out[name] = version
    return out


@dataclass(frozen=True)
class Run:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class Place:
    """Where one run happens: its tools, the proxy, its episode, its own directories."""

    tools: Path  # install_dir()
    proxy: str  # http://127.0.0.1:PORT
    episode: str
    home: Path
    work: Path
    # The episode's URL as its registration returned it (/episodes/<id>~<key>, no /v1):
    # a registered episode's calls must carry its key.
    episode_url: str = ""

    @property
    def openai_url(self) -> str:
        return f"{self.episode_url}/v1"

    @property
    def anthropic_url(self) -> str:  # the Anthropic SDK adds /v1 itself
        return self.episode_url

    def bin(self, name: str) -> str:
        return str(self.tools / "npm" / "bin" / name)

    def base_env(self) -> dict[str, str]:
        node = Path(shutil.which("node") or "/usr/bin/node").parent
        return {"PATH": f"{node}:/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home),
                "LANG": "C.UTF-8", "TMPDIR": str(self.home), "NO_COLOR": "1",
                "DO_NOT_TRACK": "1"}


def claude_code(place: Place, model: str | None = None) -> Run:
    env = place.base_env() | {
        "ANTHROPIC_BASE_URL": place.anthropic_url,
        "ANTHROPIC_API_KEY": "dummy",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    argv = [place.bin("claude"), "-p", TASK, "--allowedTools", "Read",
            "--disallowedTools", "Agent", "--max-turns", "4"]
    return Run(argv + (["--model", model] if model else []), env)


def claude_code_agents(place: Place) -> Run:
    """Claude Code with its Agent tool: the engine's first tool call starts a sub-agent
    (tests/harness_matrix/steer.py makes it a real one, in the foreground)."""
    run = claude_code(place)
    argv = list(run.argv)
    at = argv.index("--disallowedTools")
    del argv[at:at + 2]
    argv[argv.index("--allowedTools") + 1] = "Read,Agent"
    return Run(argv, run.env)


def codex(place: Place) -> Run:
    codex_home = place.home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text(f"""\
model = "{MODEL}"
model_provider = "tracetap"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[analytics]
enabled = false

[features]
plugins = false  # no curated-plugin sync from github.com / chatgpt.com at startup

[model_providers.tracetap]
name = "tracetap"
base_url = "{place.openai_url}"
wire_api = "responses"
env_key = "TRACETAP_KEY"
""")
    env = place.base_env() | {"CODEX_HOME": str(codex_home), "TRACETAP_KEY": "dummy"}
    return Run([place.bin("codex"), "exec", "--skip-git-repo-check", TASK], env)


def qwen_code(place: Place) -> Run:
    settings = place.home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}},
        "permissions": {"deny": ["agent"]},  # removes the sub-agent tool (module docstring)
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }))
    env = place.base_env() | {
        "OPENAI_BASE_URL": place.openai_url,
        "OPENAI_API_KEY": "dummy",
        "OPENAI_MODEL": MODEL,
        "QWEN_TELEMETRY_ENABLED": "false",
        "QWEN_CODE_SUPPRESS_YOLO_WARNING": "1",
    }
    return Run([place.bin("qwen"), "-p", TASK, "--yolo"], env)


def opencode(place: Place) -> Run:
    config = place.home / ".config" / "opencode" / "opencode.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"},
        "provider": {"tracetap": {
            "npm": "@ai-sdk/openai-compatible",  # bundled in the binary: nothing to fetch
            "name": "tracetap",
            "options": {"baseURL": place.openai_url, "apiKey": "dummy"},
            "models": {MODEL: {"name": MODEL}},
        }},
        "model": f"tracetap/{MODEL}",
    }))
    env = place.base_env() | {
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        # At startup opencode installs @opencode-ai/plugin into its config folder from
        # the npm registry; it runs the same without it, so the registry is a closed port.
        "NPM_CONFIG_REGISTRY": CLOSED_PORT,
        "BUN_CONFIG_REGISTRY": CLOSED_PORT,
    }
    return Run([place.bin("opencode"), "run", TASK], env)


def framework(name: str):
    """A runner for one framework of frameworks.py, in the frameworks' own venv."""

    def run(place: Place) -> Run:
        env = place.base_env() | {"OPENAI_BASE_URL": place.openai_url,
                                  "OPENAI_API_KEY": "dummy", "HARNESS_MODEL": MODEL,
                                  "OPENAI_AGENTS_DISABLE_TRACING": "1",
                                  "LANGCHAIN_TRACING_V2": "false"}
        python = str(place.tools / "venv" / "bin" / "python")
        return Run([python, str(HERE / "frameworks.py"), name], env)

    return run


def claude_code_compacted(place: Place) -> list[Run]:
    """Claude Code's /compact, driven without a terminal: the task, then ``/compact`` and
    one more prompt in the same session (``--continue``: the latest session of the
    working directory)."""
    first = claude_code(place)
    again = [first.argv[0], "--continue", "-p"]
    rest = first.argv[3:]  # the tool settings and the turn limit
    return [first, Run([*again, "/compact"], first.env),
            Run([*again, "Now say the answer again.", *rest], first.env)]


def codex_compacted(place: Place) -> Run:
    """Codex with auto-compaction at a limit below its first prompt: it compacts after
    the first tool round (tests/harness_matrix/steer.py ends the turn after that)."""
    run = codex(place)
    config = place.home / ".codex" / "config.toml"
    config.write_text(config.read_text().replace(
        "check_for_update_on_startup = false\n",
        "check_for_update_on_startup = false\nmodel_auto_compact_token_limit = 1000\n"))
    return run

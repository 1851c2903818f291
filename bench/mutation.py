"""Mutation testing of the modules that carry tracetap's promises, with mutmut.

A habit, not a CI gate: run it after changing one of these modules or its tests. Each
module is mutated on its own, in a scratch copy of the repository, and tested with only
the fast tests that exercise it (MODULES below; mutmut narrows that further to the tests
that call the mutated function). Tests that run the proxy as a subprocess do not count:
mutmut only sees the functions called in its own process.

    pip install 'mutmut>=3.8,<4'      # not a test dependency: nothing imports it
    nice -n 10 python bench/mutation.py                      # all modules: long, see docs
    nice -n 10 python bench/mutation.py storage/journal.py   # one module
    python bench/mutation.py --show                          # also print each survivor's diff

For each module it prints the mutants, how many the tests killed, and every survivor:
either one that bench/mutation-equivalents.md lists as equivalent (with why), or
UNEXPLAINED, which a new test should kill. The exit status is 1 when a module scores
under --target or any survivor is unexplained. Do not edit the repository while it runs:
each module's scratch copy is taken when that module starts.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "bench" / "mutation-equivalents.md"  # the equivalent mutants, with why

# module -> the fast tests that exercise it
_RELAY = ["tests/test_relay.py", "tests/test_capture.py", "tests/test_prompt_cut.py"]
# The driver: its life (lifecycle), the journal and budget rules (call_driver), a weight
# sync's rejoin, --translate auto's reroute after a 404.
_DRIVER = [*_RELAY, "tests/test_faults.py", "tests/test_call_driver.py",
           "tests/test_call_lifecycle.py", "tests/test_whole_reply.py", "tests/test_weight_sync.py",
           "tests/test_apis_capture.py::test_auto_translates_after_the_upstream_answers_404"]
# capture.py and relay.py run their own lists, narrower than _DRIVER. Nearly every test
# here starts a proxy (about a second each on this machine), and a survivor of a function
# every call goes through (``_drive``, ``finish``, ``Relay.event``) costs a run of all of
# them: the whole _DRIVER made a module's run take hours. Each list keeps the tests that
# defend that module's promises and leaves out those that only repeat its code path:
# - capture.py, the driver: the journal before [DONE] and the client's bytes
#   (test_relay.py), the lifecycle, budgets, whole replies, weight syncs, the 404
#   reroute, --translate auto's route picked from the request (a tool loop on vLLM) and
#   the episode's history repair (the episode the request is prepared for), native
#   Responses left native, an overlay's hooks after the 404 reroute, the upstream picked
#   by model and by episode; not
#   test_capture.py (the chat reassembly: its own module's list) nor test_prompt_cut.py
#   (relay.py's prompt cut);
# - relay.py: the journal before [DONE], the read boundary with [DONE] and the bytes
#   (test_relay.py, test_capture.py), the prompt cut, the lifecycle's stream endings, the
#   upstream's faults, whole replies and a held stream (test_call_driver.py, and the three
#   overlay tests whose hold lets text before the first tool call go out live), and one
#   stream for each part of the call the relay is given (_RELAY_PARTS); not the weight
#   syncs (proxy.call.continuation's, around the relay).
# Both leave out (-k, _SLOW) the two slowest tests, 12 s of a 150 s run: the backpressure
# test (aiohttp's buffers, no line of these modules) and fifty concurrent streams (the
# same path fifty times).
_CAPTURE = ["tests/test_relay.py", "tests/test_faults.py", "tests/test_call_driver.py",
            "tests/test_call_lifecycle.py", "tests/test_whole_reply.py",
            "tests/test_weight_sync.py",
            "tests/test_apis_capture.py::test_auto_translates_after_the_upstream_answers_404",
            "tests/test_apis_capture.py::"
            "test_responses_translated_to_chat_tool_loop_is_token_exact[auto-vllm]",
            "tests/test_repair.py::"
            "test_repair_is_off_unless_asked_and_on_for_every_episode_with_the_flag",
            "tests/test_apis_capture.py::test_responses_native_on_vllm_is_transparent_and_token_exact",
            "tests/test_overlays.py::test_the_first_call_translate_auto_falls_back_for_runs_the_hooks",
            "tests/test_upstream_pool.py::test_a_call_goes_to_the_upstream_of_its_model",
            "tests/test_upstream_pool.py::test_three_upstreams_affinity_failover_and_return"]
_HELD_LIVE = ["tests/test_overlays.py::" + name for name in (
    "test_text_before_the_first_tool_call_streams_live_and_a_veto_sends_the_new_calls",
    "test_a_reply_without_tool_calls_streams_live_and_is_not_judged",
    "test_translated_streams_stay_well_formed_with_live_text_and_a_veto")]
# What Relay.__init__ reads off the call, one stream each: the client's translator, a
# reassembly without per-choice token counts (native Messages), the counts that date
# each token's version, the experts' routing, the timings (time to first token).
_RELAY_PARTS = ["tests/test_metrics.py::test_scrape_after_known_traffic",
    "tests/test_apis_capture.py::test_sdk_streams_ending_on_length_keep_the_text_of_the_last_chunk",
    "tests/test_apis_capture.py::test_a_translated_stream_is_written_from_the_request",
    "tests/test_apis_capture.py::test_messages_native_when_asked_stores_text_without_ids",
    "tests/test_policy_spans.py::test_a_stream_across_a_weight_sync_stores_spans_with_the_sync_window_unknown",
    "tests/test_routed_experts.py::test_routing_is_stored_and_exported_aligned_and_never_reaches_the_agent"]
_RELAY_ONLY = [*_RELAY, "tests/test_faults.py", "tests/test_call_lifecycle.py",
               "tests/test_whole_reply.py",
               "tests/test_call_driver.py::test_a_held_stream_is_journaled_before_its_end_reaches_the_client",
               *_HELD_LIVE, *_RELAY_PARTS,
               # the native APIs' end (an event that carries data), a translated client's
               # stream around what it must not get (a comment, a broken chunk), logprobs
               "tests/test_native_stream_journal.py", "tests/test_translated_relay.py"]
_QUARANTINE = ["tests/test_quarantine.py", "tests/test_quarantine_proxy.py"]
_MESSAGES = ["tests/test_translate_messages.py", "tests/test_apis_capture.py"]
_RESPONSES = ["tests/test_translate_responses.py", "tests/test_apis_capture.py"]
# Translation is pure: its own tests (Hypothesis streams included) defend it, in seconds.
# Native capture is reached only through the proxy: the SDK tests of both APIs.
_CAPTURE_APIS = ["tests/test_apis_capture.py"]
_REPLIES = "tests/test_translated_replies_and_errors.py"
_ENDINGS = "tests/test_translated_stream_start_and_end.py"
_FAST_PATH = "tests/test_translated_stream_fast_path.py"
_REFERENCE = "tests/test_startup.py::test_the_command_reference_is_up_to_date"
_TOKEN_IDS = ["tests/test_resolve.py", "tests/test_token_ids.py", "tests/test_local_tokenizer.py"]
MODULES = {
    "storage/journal.py": ["tests/test_journal.py", "tests/test_writer.py"],
    "storage/writer.py": ["tests/test_writer.py", "tests/test_journal.py"],
    # The writer's quarantine path: a record refused is kept aside, never blocks another.
    "storage/refusal.py": _QUARANTINE,
    "storage/storable.py": _QUARANTINE,
    "storage/quarantine.py": _QUARANTINE,
    # Its help is the documented reference (docs/reference.md, generated from it).
    "storage/quarantine_command.py": [*_QUARANTINE, _REFERENCE],
    "storage/retention.py": ["tests/test_prune.py", "tests/test_prune_blocks.py"],
    "proxy/apis/chat/inject.py": ["tests/test_inject.py", "tests/test_relay.py",
                                  "tests/test_hostile_tokens.py"],
    # A weight sync's continuation: its upstream body field by field, usage = ids.
    "proxy/call/continuation.py": ["tests/test_continuation.py", "tests/test_weight_sync.py"],
    # What of a request reaches the engine: the body the recording engine got, per API.
    "proxy/apis/fields.py": ["tests/test_hostile_controls.py"],
    "proxy/episodes/tagging.py": ["tests/test_keys.py", "tests/test_security.py"],
    # One call's capture and the relay: journaled before [DONE], the client's bytes.
    "proxy/call/driver.py": _CAPTURE,
    "proxy/call/relay.py": _RELAY_ONLY,
    "proxy/call/review.py": ["tests/test_call_driver.py", "tests/test_overlays.py"],
    # The path checked and routed, the base-URL probe, the refusals, passthrough: the
    # exposure and hostile-request tests, the metrics' route labels, the passthrough
    # record (test_integrity.py), the episode paths (test_keys.py), a captured stream's
    # bytes (test_relay.py). Not _DRIVER: every test there goes through agent_request,
    # and none checks more of it than that the call arrived.
    "proxy/call/handlers.py": ["tests/test_passthrough.py", "tests/test_exposure.py",
                          "tests/test_hostile_agent.py",
                          "tests/test_hostile_edge.py", "tests/test_hostile_episodes.py",
                          "tests/test_api_errors.py", "tests/test_integrity.py",
                          "tests/test_metrics.py", "tests/test_keys.py", "tests/test_relay.py"],
    # Chat and completions captured: ids in order of trust, streams reassembled.
    "proxy/apis/chat/capture.py": ["tests/test_assemble.py", "tests/test_parser_fuzz.py",
                                   "tests/test_prompt_cut.py", "tests/test_capture.py"],
    "proxy/apis/chat/pieces.py": ["tests/test_assemble.py", "tests/test_capture.py"],
    # A stream's usual chunk cut by byte ranges: strip_chunk's bytes, Capture.add's capture.
    "proxy/apis/chat/strip_fast.py": ["tests/test_strip_fast.py", "tests/test_relay.py"],
    "proxy/apis/chat/stream_step.py": ["tests/test_strip_fast.py", "tests/test_relay.py"],
    # Capture and translation of the Messages and Responses APIs.
    # The chat reply read for both translations; _FAST_PATH and _REPLIES read chunks from
    # their bytes and odd whole replies, as the relay and the whole-reply path do.
    "proxy/apis/chat/reply.py": ["tests/test_chat_reply.py", *_MESSAGES,
                                 "tests/test_translate_responses.py", _FAST_PATH, _REPLIES],
    # The requests the shipped CLIs send (test_harness_requests.py): every text, call and
    # result carried over, and exactly what each drops.
    "proxy/apis/messages/request.py": [*_MESSAGES, "tests/test_harness_requests.py"],
    "proxy/apis/messages/translate.py": ["tests/test_translate_messages.py", _REPLIES,
                                         _ENDINGS, _FAST_PATH],
    "proxy/apis/messages/capture.py": _CAPTURE_APIS,
    "proxy/apis/responses/request.py": _RESPONSES,
    # The conversations the shipped CLIs send (test_harness_requests.py): every item kept.
    "proxy/apis/responses/history.py": [*_RESPONSES, "tests/test_harness_requests.py"],
    # The response object of a whole reply and of a stream's start and end.
    "proxy/apis/responses/objects.py": [*_RESPONSES, _REPLIES, _ENDINGS],
    "proxy/apis/responses/stream.py": ["tests/test_translate_responses.py", _ENDINGS,
                                       _FAST_PATH],
    "proxy/apis/responses/translate.py": ["tests/test_translate_responses.py", _REPLIES],
    "proxy/apis/responses/capture.py": _CAPTURE_APIS,
    # Token ids recovered from the engine's tokenizer, or refused.
    "proxy/tokens/resolve.py": _TOKEN_IDS,
    "proxy/tokens/engine_tokenizer.py": ["tests/test_tokenizers.py", *_TOKEN_IDS],
    "proxy/admin/token.py": ["tests/test_admin.py", *(
        "tests/test_hostile_agent.py::" + name for name in (
            "test_an_empty_admin_token_file_never_opens_the_admin_api",
            "test_the_generated_admin_token_is_owner_only_and_shared_by_a_racing_start"))],
    "proxy/http/exposure.py": ["tests/test_exposure.py", "tests/test_hostile_agent.py"],
    "proxy/episodes/budgets.py": ["tests/test_budgets.py", "tests/test_hostile_episodes.py",
                         "tests/test_hostile_agent.py", "tests/test_hostile_episode_trust.py::"
                         "test_cut_streams_are_charged_the_tokens_that_went_out"],
    "storage/integrity.py": ["tests/test_integrity.py"],
    "exporters/trajectories.py": ["tests/test_trajectories.py"],
    "exporters/pipeline.py": ["tests/test_export_runs.py"],
    "exporters/watermark.py": ["tests/test_export_runs.py"],
}
# Extra pytest arguments for a module's runs. The driver and the relay do not touch the
# database: their tests' Postgres variants run the same code as the SQLite ones, behind a
# slower setup (a migrated database per test), and a survivor costs a whole run of its
# tests. The storage modules keep both. Chat capture too reads no database: with the
# Postgres half of test_capture.py its run did 92 of 410 mutants in 21 minutes (load 8).
_SQLITE_ONLY = ["-k", "not postgres"]
_SLOW = ["-k", "not postgres and not backpressure and not fifty_concurrent"]
PYTEST_ARGS = {module: _SQLITE_ONLY for module in (
    "proxy/call/review.py", "proxy/call/handlers.py", "proxy/apis/chat/capture.py")}
PYTEST_ARGS |= {module: _SLOW for module in ("proxy/call/driver.py", "proxy/call/relay.py")}
# The top-level folders pyproject.toml installs as tracetap.<folder>. The scratch copy puts
# them under tracetap/, so the tests' `tracetap.proxy...` imports find mutmut's mutated
# copy (mutants/ comes first on sys.path, before the editable install's finder) under the
# module names mutmut derives from the file paths.
PACKAGES = ["proxy", "storage", "exporters", "demo", "migrations", "analysis", "viewer"]
KILLED = {"killed", "timeout", "segfault", "caught by type check"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE",
                        help=f"default: all of {', '.join(MODULES)}")
    parser.add_argument("--workdir", type=Path,
                        default=Path(tempfile.gettempdir()) / "tracetap-mutation")
    parser.add_argument("--max-children", type=int, default=2, help="parallel mutants")
    parser.add_argument("--target", type=float, default=0.9, help="killed share to reach")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the last run's results in --workdir against "
                             "bench/mutation-equivalents.md as it is now (after listing "
                             "equivalents)")
    args = parser.parse_args(argv)
    unknown = set(args.modules) - set(MODULES)
    if unknown:
        parser.error(f"not a module of MODULES: {', '.join(sorted(unknown))}")
    if shutil.which("mutmut") is None:
        print("mutmut is not installed: pip install 'mutmut>=3.8,<4'", file=sys.stderr)
        return 2

    equivalents = documented_equivalents(DOC)
    failed = False
    rows = []
    for module in args.modules or list(MODULES):
        started = time.monotonic()
        results = (read_results(args.workdir / _slug(module)) if args.report_only
                   else run_module(module, args.workdir, args.max_children))
        seconds = time.monotonic() - started
        survivors = {name: status for name, status in results.items() if status not in KILLED}
        killed = len(results) - len(survivors)
        score = killed / len(results) if results else 1.0
        unexplained = 0
        print(f"\n{module}: {len(results)} mutants, {killed} killed, {len(survivors)} not "
              f"({score:.1%} killed) in {seconds:.0f}s")
        for name, status in sorted(survivors.items(), key=lambda kv: _number(kv[0])):
            change = mutant_change(args.workdir / _slug(module), name)
            why = equivalents.get((_function(name), change))
            if why is None:
                unexplained += 1
            label = "equivalent" if why else "UNEXPLAINED"
            print(f"  {label:<11} {status:<10} {_function(name)} #{_number(name)}: "
                  f"`{change[0]}` -> `{change[1]}`")
            if args.show:
                print(_indent(mutant_diff(args.workdir / _slug(module), name)))
        rows.append((module, len(results), killed, score, unexplained))
        failed |= score < args.target or unexplained > 0

    total = sum(r[1] for r in rows)
    killed = sum(r[2] for r in rows)
    print(f"\n{'module':<36}{'mutants':>8}{'killed':>8}{'score':>8}{'unexplained':>13}")
    for module, n, k, score, unexplained in rows:
        print(f"{module:<36}{n:>8}{k:>8}{score:>8.1%}{unexplained:>13}")
    if total:
        print(f"{'all':<36}{total:>8}{killed:>8}{killed / total:>8.1%}"
              f"{sum(r[4] for r in rows):>13}")
    return 1 if failed else 0


def run_module(module: str, workdir: Path, max_children: int) -> dict[str, str]:
    """Mutate ``module`` in a fresh scratch copy; mutant name -> mutmut's status."""
    scratch = workdir / _slug(module)
    if scratch.exists():
        shutil.rmtree(scratch)
    _copy_repository(scratch)
    tests = "\n    ".join(MODULES[module])
    (scratch / "setup.cfg").write_text(
        "[mutmut]\n"
        "source_paths =\n    tracetap\n"
        f"only_mutate =\n    tracetap/{module}\n"
        f"pytest_add_cli_args_test_selection =\n    {tests}\n"
        # The tests of the command reference read docs/reference.md beside them.
        "also_copy =\n    docs\n"
        # A mutant that breaks start-up leaves unclosed sessions behind: the tests that
        # fail already count, a leak warning at exit must not crash mutmut's own run.
        "pytest_add_cli_args =\n    -p\n    no:cacheprovider\n"
        "    -W\n    ignore::pytest.PytestUnraisableExceptionWarning\n"
        + "".join(f"    {arg}\n" for arg in PYTEST_ARGS.get(module, ())))
    log = scratch / "mutmut.log"
    with open(log, "wb") as out:
        done = subprocess.run(["mutmut", "run", "--max-children", str(max_children)],
                              cwd=scratch, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"mutmut failed on {module} (exit {done.returncode}); see {log}:\n"
                         + log.read_text(errors="replace")[-3000:])
    return read_results(scratch)


def read_results(scratch: Path) -> dict[str, str]:
    """Mutant name -> mutmut's status, from a scratch copy mutmut has run in."""
    listing = subprocess.run(["mutmut", "results", "--all", "true"], cwd=scratch,
                             capture_output=True, text=True, check=True).stdout
    return dict(re.findall(r"^\s+(\S+): (.+)$", listing, re.MULTILINE))


def mutant_diff(scratch: Path, name: str) -> str:
    return subprocess.run(["mutmut", "show", name], cwd=scratch, capture_output=True,
                          text=True, check=True).stdout


def mutant_change(scratch: Path, name: str) -> tuple[str, str]:
    """The mutated source: (removed lines, added lines), each joined and stripped."""
    lines = mutant_diff(scratch, name).splitlines()
    old = " ".join(x[1:].strip() for x in lines if x.startswith("-") and not x.startswith("---"))
    new = " ".join(x[1:].strip() for x in lines if x.startswith("+") and not x.startswith("+++"))
    return old, new


def documented_equivalents(doc: Path) -> dict[tuple[str, tuple[str, str]], str]:
    """Rows of the doc's equivalent-mutant tables: | `function` | `old` → `new` | why |.

    Matched on the function and the change, not on mutmut's numbers, which shift when
    the function is edited."""
    row = re.compile(r"^\|\s*`(?P<function>[^`]+)`\s*\|\s*`(?P<old>[^`]*)`\s*→\s*"
                     r"`(?P<new>[^`]*)`\s*\|(?P<why>.+)\|\s*$")
    found = {}
    for line in doc.read_text().splitlines() if doc.exists() else ():
        match = row.match(line)
        if match:
            old, new = (match[k].replace("\\|", "|") for k in ("old", "new"))
            found[(match["function"], (old, new))] = match["why"].strip()
    return found


def _copy_repository(scratch: Path) -> None:
    """The working tree as git sees it (tracked and new files, nothing ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            top = name.split("/", 1)[0]
            target = scratch / ("tracetap/" + name if top in PACKAGES else name)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def _function(name: str) -> str:
    """``tracetap.storage.writer.xǁWriterǁ_run__mutmut_3`` -> ``storage.writer.Writer._run``."""
    qualified = name.rsplit("__mutmut_", 1)[0].removeprefix("tracetap.")
    module, _, function = qualified.rpartition(".")
    if function.startswith("xǁ"):
        function = ".".join(function[2:].split("ǁ"))
    elif function.startswith("x_"):
        function = function[2:]
    return f"{module}.{function}"


def _number(name: str) -> int:
    return int(name.rsplit("__mutmut_", 1)[1])


def _slug(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())

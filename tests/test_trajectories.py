"""The prefix tree on its own: hand-made episodes, then random call forests (hypothesis)."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracetap.exporters.trajectories import SPLIT_REASONS, build_trajectories
from tracetap.storage.scan import ScannedCall, ScannedChoice


def make_call(call_id, t_start, prompt, completions, *, t_end=None, logprobs=True, seq=0,
              instance="", status="ok", http_status=200, finish_reason="stop",
              policy_version=None, ids_missing=None):
    choices = []
    for index, completion in enumerate(completions):
        lp = None
        if completion is not None and logprobs:
            lp = array("d", [-(k + 1) / 8 - index for k in range(len(completion))]).tobytes()
        choices.append(ScannedChoice(
            index=index, finish_reason=finish_reason, completion_logprobs=lp,
            completion_ids=None if completion is None else array("i", completion).tobytes(),
            token_source="engine" if completion is not None else "none"))
    return ScannedCall(
        call_id=call_id, seq=seq, instance=instance, t_start=t_start,
        t_end=t_start + 1 if t_end is None else t_end, status=status, http_status=http_status,
        policy_version=policy_version, ids_missing=ids_missing,
        prompt_ids=None if prompt is None else array("i", prompt).tobytes(), choices=choices)


def rows(calls):
    return [(t.call_ids, list(t.prompt_ids), list(t.response_ids), list(t.response_mask),
             t.split_reason) for t in build_trajectories(calls)]


def test_append_only_turns_make_one_row_with_every_completion_trainable():
    calls = [
        make_call("a", 0, [1, 2], [[3, 4]], policy_version="v1"),
        make_call("b", 2, [1, 2, 3, 4, 9], [[5]], policy_version="v1"),
        make_call("c", 4, [1, 2, 3, 4, 9, 5, 8, 8], [[6, 7]], policy_version="v2",
                  finish_reason="length"),
    ]
    [t] = build_trajectories(calls)
    assert t.call_ids == ["a", "b", "c"] and t.num_turns == 3
    assert list(t.prompt_ids) == [1, 2]
    assert list(t.response_ids) == [3, 4, 9, 5, 8, 8, 6, 7]
    assert list(t.response_mask) == [1, 1, 0, 1, 0, 0, 1, 1]
    assert list(t.response_logprobs) == [-1 / 8, -2 / 8, 0, -1 / 8, 0, 0, -1 / 8, -2 / 8]
    assert t.split_reason is None
    assert t.finish_reason == "length"  # the last completion's, cut by max_tokens
    assert t.policy_versions == ["v1", "v1", "v2"]
    assert t.trajectory_id == "c:0"


def test_a_rewritten_context_starts_a_new_root():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("b", 2, [1, 2, 3], [[4]]),
        make_call("c", 4, [7, 7], [[8]]),  # summarised: extends nothing
        make_call("d", 6, [7, 7, 8, 9], [[5]]),
    ]
    assert rows(calls) == [
        (["a", "b"], [1], [2, 3, 4], [1, 0, 1], None),
        (["c", "d"], [7, 7], [8, 9, 5], [1, 0, 1], "non_prefix"),
    ]


def test_n_samples_share_their_prefix_which_is_trained_once():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("b", 2, [1, 2, 3], [[4], [5]]),  # n=2
        make_call("c", 4, [1, 2, 3, 4, 6], [[7]]),  # continues choice 0
    ]
    assert rows(calls) == [
        (["a", "b", "c"], [1], [2, 3, 4, 6, 7], [1, 0, 1, 0, 1], None),
        (["a", "b"], [1], [2, 3, 5], [0, 0, 1], "sample"),
    ]


def test_a_retry_with_the_same_prompt_is_a_branch_marked_retry():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("b", 2, [1, 2, 3], [[4]]),
        make_call("b2", 4, [1, 2, 3], [[5]]),
    ]
    assert rows(calls)[1] == (["a", "b2"], [1], [2, 3, 5], [0, 0, 1], "retry")


def test_a_different_continuation_of_the_same_context_is_a_branch():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("b", 2, [1, 2, 3], [[4]]),
        make_call("c", 4, [1, 2, 9], [[5]]),
    ]
    assert rows(calls)[1] == (["a", "c"], [1], [2, 9, 5], [0, 0, 1], "branch")


def test_the_longest_finished_prefix_is_the_parent():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("b", 2, [1, 2, 3], [[4]]),
        make_call("late", 3, [1, 2, 3, 4, 5], [[6]], t_end=20),  # still running at t=6
        make_call("c", 6, [1, 2, 3, 4, 5, 6, 7], [[8]]),
    ]
    by_leaf = {t.call_ids[-1]: t.call_ids for t in build_trajectories(calls)}
    assert by_leaf["c"] == ["a", "b", "c"]  # "late" had not finished when c started
    assert by_leaf["late"] == ["a", "b", "late"]


def test_arrival_order_is_t_start_then_instance_then_seq():
    calls = [
        make_call("second", 0, [1], [[3]], instance="i", seq=1),
        make_call("first", 0, [1], [[2]], instance="i", seq=0),
    ]
    assert [t.call_ids for t in build_trajectories(calls)] == [["first"], ["second"]]
    assert [t.split_reason for t in build_trajectories(calls)] == [None, "retry"]


def test_failed_calls_are_left_out():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("boom", 2, [1, 2, 3], [[9]], http_status=500),
        make_call("cut", 4, [1, 2, 3], [[9]], status="client_disconnected"),
        make_call("b", 6, [1, 2, 3], [[4]]),
    ]
    assert rows(calls) == [(["a", "b"], [1], [2, 3, 4], [1, 0, 1], None)]


def test_calls_without_token_ids_are_left_out_and_counted_by_why():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("text", 2, None, [None, None], ids_missing="no_chat_template"),
        make_call("half", 4, None, [[5, 6]]),
        make_call("b", 6, [1, 2, 7], [[3]]),
    ]
    left_out: dict[str, int] = {}
    trajectories = build_trajectories(calls, left_out=left_out)
    assert [t.call_ids for t in trajectories] == [["a", "b"]]
    assert left_out == {"no_chat_template": 2, "no_token_ids": 1}
    assert build_trajectories(calls)[0].call_ids == ["a", "b"]  # counting is optional


def test_kept_calls_without_token_ids_are_marked_single_turn_rows_never_stitched():
    calls = [
        make_call("a", 0, [1], [[2]]),
        make_call("text", 2, None, [None]),
        make_call("half", 4, None, [[5, 6]]),
    ]
    left_out: dict[str, int] = {}
    trajectories = build_trajectories(calls, keep_untokenized=True, left_out=left_out)
    assert left_out == {}
    assert [(t.call_ids, t.split_reason) for t in trajectories] == [
        (["a"], None), (["text"], "no_token_ids"), (["half"], "no_token_ids")]
    half = trajectories[2]
    assert list(half.prompt_ids) == [] and list(half.response_ids) == [5, 6]
    assert list(half.response_mask) == [1, 1]
    assert list(trajectories[1].response_ids) == []


def test_missing_logprobs_on_a_trainable_turn_make_the_row_logprobs_null():
    calls = [
        make_call("a", 0, [1], [[2]], logprobs=False),
        make_call("b", 2, [1, 2], [[3]]),
        make_call("b2", 4, [1, 2], [[4]]),
    ]
    main, retry = build_trajectories(calls)
    assert main.response_logprobs is None  # a's completion is trainable here
    assert list(retry.response_logprobs) == [0.0, -1 / 8]  # a is context in this row


def test_plain_lists_are_accepted():
    class Choice:
        index, finish_reason = 0, "stop"
        completion_ids, completion_logprobs = [2], [-0.5]

    class Call:
        call_id, seq, instance, t_start, t_end = "x", 0, "", 0.0, 1.0
        status, http_status, policy_version = "ok", 200, None
        prompt_ids, choices = [1], [Choice()]

    [t] = build_trajectories([Call()])
    assert list(t.prompt_ids) == [1] and list(t.response_logprobs) == [-0.5]



def test_a_single_turn_row_carries_its_own_call_and_choice():
    class Choice:
        index, finish_reason = 1, "length"
        completion_ids, completion_logprobs = [5, 6], [-0.5, -0.25]

    class Call:  # plain lists, as a Python caller would pass them
        call_id, seq, instance, t_start, t_end = "half", 0, "", 0.0, 1.0
        status, http_status, policy_version = "ok", 200, "v3"
        prompt_ids, choices = None, [Choice()]

    assert build_trajectories([Call()]) == []  # by default: no ids, no training row
    [t] = build_trajectories([Call()], keep_untokenized=True)
    assert (t.trajectory_id, t.call_ids, t.choice_indices) == ("half:1", ["half"], [1])
    assert (t.split_reason, t.finish_reason, t.policy_versions) == (
        "no_token_ids", "length", ["v3"])
    assert list(t.prompt_ids) == [] and list(t.response_ids) == [5, 6]
    assert list(t.response_mask) == [1, 1]
    assert list(t.response_logprobs) == [-0.5, -0.25]

    Call.prompt_ids, Choice.completion_ids = [1, 2], None  # a prompt but no completion ids
    [t] = build_trajectories([Call()], keep_untokenized=True)
    assert list(t.prompt_ids) == [1, 2] and list(t.response_ids) == []
    assert list(t.response_logprobs) == []


def test_a_single_turn_row_from_storage_bytes_keeps_its_logprobs():
    [t] = build_trajectories([make_call("half", 0, None, [[5, 6, 7]])], keep_untokenized=True)
    assert list(t.response_ids) == [5, 6, 7]
    assert list(t.response_logprobs) == [-1 / 8, -2 / 8, -3 / 8]


def test_choices_stored_out_of_order_are_read_in_index_order():
    call = make_call("a", 0, [1], [[2], [3]])
    call.choices.reverse()  # index 1 first, as a database may return them
    assert [(t.choice_indices, t.split_reason) for t in build_trajectories([call])] == [
        ([0], None), ([1], "sample")]


def test_logprobs_that_do_not_pair_with_the_ids_are_unknown():
    call = make_call("a", 0, [1], [[2, 3]])
    call.choices[0].completion_logprobs = array("d", [-0.5]).tobytes()  # one for two ids
    [t] = build_trajectories([call])
    assert t.response_logprobs is None and list(t.response_mask) == [1, 1]


def test_a_turn_without_logprobs_still_masks_every_later_turn():
    calls = [
        make_call("a", 0, [1], [[2]], logprobs=False),
        make_call("b", 2, [1, 2, 9], [[3]]),
        make_call("c", 4, [1, 2, 9, 3, 9], [[4]]),
    ]
    [t] = build_trajectories(calls)
    assert t.response_logprobs is None
    assert list(t.response_ids) == [2, 9, 3, 9, 4]
    assert list(t.response_mask) == [1, 0, 1, 0, 1]

# ---- property: random call forests -------------------------------------------------------

TOKENS = st.lists(st.integers(0, 2), max_size=3)  # a tiny vocabulary: accidental prefixes


@st.composite
def episodes(draw):
    """Calls that extend, retry or ignore earlier ones, overlapping in time at random."""
    calls, made = [], []  # made: (prompt, completion) of usable nodes so far
    t = 0
    for i in range(draw(st.integers(1, 9))):
        t += draw(st.integers(0, 2))
        mode = draw(st.sampled_from(["fresh", "extend", "extend", "retry"])) if made else "fresh"
        if mode == "extend":
            prompt, completion = draw(st.sampled_from(made))
            prompt = prompt + completion + draw(TOKENS)
        elif mode == "retry":
            prompt = draw(st.sampled_from(made))[0]
        else:
            prompt = draw(st.lists(st.integers(0, 2), min_size=1, max_size=4))
        completions = [draw(TOKENS) for _ in range(draw(st.integers(1, 3)))]
        failed = draw(st.integers(0, 9)) == 0
        no_ids = draw(st.integers(0, 9)) == 0
        call = make_call(f"c{i}", t, None if no_ids else prompt, completions,
                         t_end=t + draw(st.integers(0, 3)), seq=i,
                         logprobs=draw(st.integers(0, 7)) > 0,
                         http_status=500 if failed else 200)
        calls.append(call)
        if not failed and not no_ids:
            made.extend((prompt, c) for c in completions)
    return draw(st.permutations(calls))  # input order must not matter


def ids(data: bytes) -> list[int]:
    return array("i", data).tolist()


def _nodes(calls):
    """Eligible tokenized nodes in arrival order: ((call_id, index) → (call, choice))."""
    ordered = sorted(calls, key=lambda c: (c.t_start, c.instance, c.seq))
    return {(c.call_id, ch.index): (c, ch) for c in ordered
            if c.status == "ok" and c.http_status == 200 and c.prompt_ids is not None
            for ch in c.choices if ch.completion_ids is not None}


def _oracle_parent(nodes, key):
    call, _ = nodes[key]
    keys = list(nodes)
    best = None
    for rank, other in enumerate(keys[:keys.index(key)]):
        p_call, p_choice = nodes[other]
        full = ids(p_call.prompt_ids) + ids(p_choice.completion_ids)
        if p_call is call or p_call.t_end > call.t_start:
            continue
        extends = ids(call.prompt_ids)[:len(full)] == full
        if extends and (best is None or (len(full), rank) >= best[0]):
            best = ((len(full), rank), other)
    return None if best is None else best[1]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(episodes())
def test_every_row_is_exact_and_every_sampled_token_is_trained_once(calls):
    nodes = _nodes(calls)
    trained = dict.fromkeys(nodes, 0)
    trajectories = build_trajectories(calls, keep_untokenized=True)
    assert all(t.split_reason in SPLIT_REASONS for t in trajectories)
    left_out: dict[str, int] = {}
    assert [t for t in build_trajectories(calls, left_out=left_out)
            if t.split_reason != "no_token_ids"] == [
        t for t in trajectories if t.split_reason != "no_token_ids"]
    tree_rows = [t for t in trajectories if t.split_reason != "no_token_ids"]
    assert sum(t.split_reason is None for t in tree_rows) == (1 if nodes else 0)
    for t in tree_rows:
        path = list(zip(t.call_ids, t.choice_indices))
        for child, parent in zip(path[1:], path):
            assert _oracle_parent(nodes, child) == parent
        assert _oracle_parent(nodes, path[0]) is None
        response, mask = list(t.response_ids), list(t.response_mask)
        logprobs = None if t.response_logprobs is None else list(t.response_logprobs)
        assert len(response) == len(mask) and (logprobs is None or len(logprobs) == len(mask))
        root_call, _ = nodes[path[0]]
        assert list(t.prompt_ids) == ids(root_call.prompt_ids)
        at, previous_end, unknown = 0, len(ids(root_call.prompt_ids)), False
        for key in path:  # the row is exactly: gap, completion, gap, completion, ...
            call, choice = nodes[key]
            gap = ids(call.prompt_ids)[previous_end:]
            assert response[at:at + len(gap)] == gap and not any(mask[at:at + len(gap)])
            at += len(gap)
            completion = ids(choice.completion_ids)
            assert response[at:at + len(completion)] == completion
            bits = set(mask[at:at + len(completion)])
            assert len(bits) <= 1
            if bits == {1}:
                trained[key] += 1
                unknown |= choice.completion_logprobs is None and bool(completion)
                if logprobs is not None:
                    stored = array("d", choice.completion_logprobs).tolist()
                    assert logprobs[at:at + len(completion)] == stored
            elif logprobs is not None:
                assert not any(logprobs[at:at + len(completion)])
            at += len(completion)
            previous_end = len(ids(call.prompt_ids)) + len(completion)
        assert at == len(response)
        assert (logprobs is None) == unknown  # null only when a trained turn had none
        leaf_call, leaf_choice = nodes[path[-1]]
        assert (list(t.prompt_ids) + response
                == ids(leaf_call.prompt_ids) + ids(leaf_choice.completion_ids))
    for key, count in trained.items():
        if len(nodes[key][1].completion_ids):
            assert count == 1, key  # every sampled token is mask 1 in exactly one row
    untokenized = [(c.call_id, ch.index) for c in calls
                   if c.status == "ok" and c.http_status == 200
                   for ch in c.choices
                   if c.prompt_ids is None or ch.completion_ids is None]
    assert len(trajectories) - len(tree_rows) == len(untokenized)
    assert sum(left_out.values()) == len(untokenized)


@pytest.mark.parametrize("turns", [1, 50])
def test_long_append_only_episodes_stay_linear(turns):
    prompt, calls = [1], []
    for i in range(turns):
        calls.append(make_call(f"t{i}", 2 * i, prompt, [[2] * 100]))
        prompt = prompt + [2] * 100 + [3]
    [t] = build_trajectories(calls)
    assert sum(t.response_mask) == 100 * turns

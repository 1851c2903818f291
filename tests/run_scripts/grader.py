"""A grader for tests/test_run.py: reads what the harness left and prints a JSON reward
(after a log line, which the runner must skip).

    grader.py EPISODE DIR EXIT_CODE
"""

import json
import sys
from pathlib import Path

episode, where, exit_code = sys.argv[1:4]
out = json.loads((Path(where) / "out" / f"{episode}.json").read_text())
task_id = out["argv"][1]
style = out["argv"][2]
print("grading", episode)  # a log line before the verdict
reward = 0.25 if style == "a" else 0.75
print(
    json.dumps(
        {
            "reward": reward,
            "rewards": {"style_b": float(style == "b")},
            "outcome": f"graded-{task_id}-{exit_code}",
        }
    )
)

"""Model-boundary overlays: an operator's lifecycle hooks on a black-box harness.

The rules (what is recorded, what is trainable, what fails how) are in docs/overlays.md.
``hooks`` is the contract an overlay implements, ``loader`` imports the operator's code
at start, ``runner`` calls hooks under a time budget and keeps each episode's overlay
state, ``context`` keeps what overlays added in the model's context, ``review`` buffers a
reply for ``after_model`` and re-samples, ``deliver`` writes a rewritten reply in the
client's API, and ``examples`` holds the three shipped overlays. Runtime patches
(untrusted code installed through the admin API): ``patches`` keeps them (stored in the
database), ``workers`` runs each in a process of its own, ``patch_worker`` is that
process, ``sandbox`` confines it, ``frames`` is the wire between the two.

Owns: `hooks`, `loader`, `runner`, `context`, `review`, `deliver`, `live`, `frames`, `replay`,
`examples`, `patches`, `workers`, `patch_worker`, `sandbox`, `bwrap`, `seccomp`.
May import: `http`, `upstream`, `apis`; and, for annotations only, the call it reviews
(`call.driver`) and the metrics it counts into (`runtime.metrics`).
"""

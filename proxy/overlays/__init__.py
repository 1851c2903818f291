"""Model-boundary overlays: an operator's lifecycle hooks on a black-box harness.

The rules (what is recorded, what is trainable, what fails how) are in docs/overlays.md.
``hooks`` is the contract an overlay implements, ``loader`` imports the operator's code
at start, ``runner`` calls hooks under a time budget and keeps each episode's overlay
state, ``context`` keeps what overlays added in the model's context, ``review`` buffers a
reply for ``after_model`` and re-samples, ``deliver`` writes a rewritten reply in the
client's API, and ``examples`` holds the three shipped overlays.
"""

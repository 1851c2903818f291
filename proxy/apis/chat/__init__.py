"""Chat completions (``POST /v1/chat/completions``) and legacy completions
(``POST /v1/completions``): OpenAI's own shapes, as vLLM serves them, and the API every
translated call speaks to its upstream.

``inject`` asks the upstream for what capture needs and takes it out again, ``wire``
holds the Structs the chat wire shape is decoded through (capture, translation and
overlays all read replies and chunks through them), ``capture`` reassembles a reply into
choice records (and holds the two ``WireApi`` objects), ``reply`` reads a chat reply for
translation, ``request`` builds a chat request from another API's, and ``errors`` is
OpenAI's error body.
"""

CHAT = "chat.completions"  # stored in calls.endpoint
COMPLETIONS = "completions"

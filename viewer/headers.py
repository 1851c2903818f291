"""Headers on every viewer response."""

# No inline script or style anywhere: agent content that slipped through escaping still
# could not run. Charts are SVG images, which never run scripts either.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # ids in URLs stay on this site
    "Cross-Origin-Opener-Policy": "same-origin",
}

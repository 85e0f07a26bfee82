"""The web console at /console: a page served by the gateway itself (no CDN, no build step),
its live figures sampled from the metrics, the recent requests, and its API under
/console/api (keys and scopes as the rest of the gateway's)."""

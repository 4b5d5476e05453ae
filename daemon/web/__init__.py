"""`oomguard serve`: a read-only web dashboard of the box (the queue, the GPUs, a job's attempts,
rungs, events and charts), for people who check on a weeks-long run from a laptop.

- app.py: the routes (Starlette), each page whole or as its live fragment;
- viewer.py: who is asking (a Unix socket's peer credentials, or a per-user token) and what
  they may see;
- tokens.py: the per-user tokens (an HMAC of the uid under a key only the server reads);
- peer.py: the uvicorn protocol that tells the app a Unix socket peer's uid;
- views.py: what each page shows, as plain values; svg_chart.py: the charts, drawn here as SVG;
- templates/ and static/: the HTML, a stylesheet and a few lines of JavaScript that refresh
  the live parts (no framework, nothing fetched from the internet).
"""

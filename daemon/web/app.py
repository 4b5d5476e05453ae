"""The dashboard's routes. Read-only: every request opens the store read-only and closes it.

Who is asking (viewer.py): over the Unix socket, the kernel says (peer.py); over TCP, the
token in the cookie set from a link that `oomguard web-url` prints (tokens.py). Without either,
a page says how to get a link and shows nothing else. A page is served whole, or with
``?fragment=1`` as its live part only, which static/dashboard.js fetches again every few
seconds (a page without JavaScript refreshes itself every 15 s instead)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from oomguard.daemon.cli.output import short_plan
from oomguard.daemon.paths import StateDir
from oomguard.daemon.store import Store
from oomguard.daemon.text import escape
from oomguard.daemon.web import views
from oomguard.daemon.web.peer import PEER_UID
from oomguard.daemon.web.step_cache import StepCache
from oomguard.daemon.web.tokens import SESSION_SECONDS, Tokens
from oomguard.daemon.web.viewer import Viewer, viewer_for
from oomguard.strategies.errors import JobNotFound
from oomguard.strategies.units import format_bytes, format_duration_short

HERE = Path(__file__).parent
COOKIE = "oomguard_session"
REFRESH_SECONDS = 3  # the live parts' period (dashboard.js reads it from the page)
# Who may reach the server by name: a page of another site that points its own name at
# 127.0.0.1 (DNS rebinding) is refused before any route runs.
LOCAL_HOSTS = ["localhost", "127.0.0.1", "::1", "[::1]"]
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a link with a token must not leak through a Referer
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class ServeSettings:
    state_dir: Path
    tokens: Tokens
    server_uid: int
    admin_group: str | None
    base_url: str  # the TCP address people open ("http://127.0.0.1:8470/")


def make_app(settings: ServeSettings) -> Starlette:
    dashboard = Dashboard(settings)
    routes = [
        Route("/", dashboard.queue),
        Route("/jobs/{job_id:int}", dashboard.job),
        Route("/gpus", dashboard.gpus),
        Route("/token", dashboard.token),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(TrustedHostMiddleware, allowed_hosts=LOCAL_HOSTS)])


class Dashboard:
    """The routes' handlers (served from a pool of threads: what they share is read-only, but
    for the step cache, which locks)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        self.templates.env.filters.update(inert=escape, size=_size, duration=_duration, clock=_clock, plan=_plan)
        self.templates.env.globals.update(refresh_seconds=REFRESH_SECONDS)
        self.database = StateDir(settings.state_dir).database
        self.steps = StepCache()  # what the job pages read of each attempt's metrics, kept between requests

    # -- the routes ------------------------------------------------------------------------

    def queue(self, request: Request) -> Response:
        number = _page_number(request.query_params.get("page"))
        if number is False:
            return self.render(request, "denied.html", {"why": "bad_page"}, 400)
        return self.page(request, lambda viewer, store: self.render(
            request, "queue.html", {"viewer": viewer, "queue": views.queue_page(store, viewer, number)},
        ))

    def job(self, request: Request) -> Response:
        def build(viewer: Viewer, store: Store) -> Response:
            key = request.path_params["job_id"]
            try:
                row = store.job(key)
            except (JobNotFound, OverflowError):  # an id past SQLite's integers: no such job either
                return self.render(request, "denied.html", {"why": "no_job", "job": key, "viewer": viewer}, 404)
            if not viewer.may_read(row):
                return self.render(request, "denied.html", {"why": "not_yours", "job": row.id, "owner": row.owner, "viewer": viewer}, 403)
            return self.render(request, "job.html", {"viewer": viewer, "job": views.job_page(store, row, self.steps.read)})

        return self.page(request, build)

    def gpus(self, request: Request) -> Response:
        return self.page(request, lambda viewer, store: self.render(request, "gpus.html", {"viewer": viewer, "gpus": views.gpu_page(store)}))

    def token(self, request: Request) -> Response:
        """A user's own link, over the Unix socket only: there the kernel says who asks."""
        uid = _peer_uid(request)
        if uid is None:
            return JSONResponse({"error": "ask for a link over the dashboard's Unix socket: run `oomguard web-url` on the box"}, status_code=403)
        return JSONResponse({"uid": uid, "url": f"{self.settings.base_url}?token={self.settings.tokens.token_for(uid)}"})

    # -- what every page shares --------------------------------------------------------------

    def page(self, request: Request, build: Callable[[Viewer, Store], Response]) -> Response:
        """A page for whoever is asking; a link's token becomes a session (and leaves the address
        bar); no one known, or no store, gets a page that says what to do."""
        token = request.query_params.get("token")
        if token is not None:
            return self.sign_in(request, token)
        viewer = self.viewer_of(request)
        if viewer is None:
            return self.render(request, "denied.html", {"why": "unknown"}, 401)
        try:
            store = Store(self.database, readonly=True)
        except FileNotFoundError as error:
            return self.render(request, "denied.html", {"why": "no_store", "error": str(error), "viewer": viewer}, 503)
        try:
            return build(viewer, store)
        finally:
            store.close()

    def sign_in(self, request: Request, token: str) -> Response:
        uid = self.settings.tokens.uid_of(token)
        if uid is None:
            return self.render(request, "denied.html", {"why": "bad_token"}, 401)
        signed_in = self.session_uid(request)
        if signed_in is not None and signed_in != uid:
            # Someone else's link (another page may have sent this browser to it) does not
            # quietly make you them.
            return self.render(request, "denied.html", {"why": "other_user", "viewer": self.viewer(signed_in)}, 409)
        response = RedirectResponse(request.url.remove_query_params("token"), status_code=303)
        response.set_cookie(
            COOKIE, self.settings.tokens.session_for(uid, time.time()), max_age=SESSION_SECONDS, httponly=True, samesite="strict", path="/",
        )
        response.headers.update(SECURITY_HEADERS)
        return response

    def viewer_of(self, request: Request) -> Viewer | None:
        uid = _peer_uid(request)
        if uid is None:
            uid = self.session_uid(request)
        return self.viewer(uid) if uid is not None else None

    def viewer(self, uid: int) -> Viewer:
        return viewer_for(uid, self.settings.server_uid, self.settings.admin_group)

    def session_uid(self, request: Request) -> int | None:
        session = request.cookies.get(COOKIE)
        return self.settings.tokens.uid_of_session(session, time.time()) if session else None

    def render(self, request: Request, name: str, context: dict[str, Any], status: int = 200) -> Response:
        # A live part asked for again: only the page's fragment (templates/_<page>.html).
        if request.query_params.get("fragment") == "1" and (HERE / "templates" / f"_{name}").exists():
            name = f"_{name}"
        response = self.templates.TemplateResponse(
            request, name, {**context, "now": time.time(), "state_dir": str(self.settings.state_dir)}, status_code=status,
        )
        response.headers.update(SECURITY_HEADERS)
        return response


def _peer_uid(request: Request) -> int | None:
    """The uid the kernel gave for a Unix socket connection (peer.py); None over TCP."""
    return request.scope.get("state", {}).get(PEER_UID)


def _page_number(text: str | None) -> int | None | bool:
    """None: no page asked (at a glance); False: not a page number."""
    if text is None:
        return None
    if not text.isascii() or not text.isdigit() or len(text) > 9 or int(text) < 1:
        return False
    return int(text)


def _plan(plan: dict[str, Any] | None) -> str:
    return short_plan(plan) if plan else ""


def _size(value: int | None) -> str:
    return format_bytes(value) if value is not None else ""


def _duration(seconds: float | None) -> str:
    return format_duration_short(seconds) if seconds is not None else ""


def _clock(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else ""

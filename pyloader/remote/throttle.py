"""Per-host request limits: one adaptive window of requests in flight per host (or S3 bucket).

NOTE [fetch throttling]: all requests of a process to one host (one bucket for S3) pass
through one ``HostLimiter`` (``host_limiter``): a window of how many may be in flight
at once. A throttled response halves the window (from the number then in flight, at
most once per round of requests: responses to requests sent before the last cut are
already accounted for) and pauses the host: for the server's ``Retry-After`` when it
gives one, else for a jittered backoff that grows with the throttled responses since
the host's last success. Each success while the window is full widens it by
``1/window`` (about one request per round: AIMD, as TCP). So a throttling storm slows
the fetchers down to what the server accepts instead of failing them. A streak is
reported as a warning on the ``pyloader.remote`` logger (printed to stderr where logging
is not configured) once it is 5 s old and every 30 s while it lasts: the host, the
throttled responses and what the last said, the window, and how long until requests
give up. Once the host
has answered nothing but throttles for ``throttle_deadline`` seconds, a request that is
throttled again, or one waiting for a window with nothing in flight, fails with the
numbers (how long, how many throttled responses, the window reached). After a second
of idleness past its pause a host's streak is forgotten; after a minute, its window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

_log = logging.getLogger("pyloader.remote")
CANCEL_POLL_S = 0.05  # a wait looks at its cancel event this often
_STREAK_IDLE_S = 1.0  # idle past the pause: the host's throttle streak is over
_WINDOW_IDLE_S = 60.0  # idle this long: the window opens again
# A host that throttles is reported on the "pyloader.remote" logger once its streak is
# this old, then at least this often while fetches wait on it (NOTE [fetch throttling]).
_THROTTLE_REPORT_FIRST_S = 5.0
_THROTTLE_REPORT_EVERY_S = 30.0


class _Cancelled(Exception):
    """``cancel`` was set while waiting (for a window, a pause or a chunk)."""


class _ThrottleExpired(Exception):
    """The host has answered only throttles for longer than the throttle deadline."""


class HostLimiter:
    """How many requests to one host (or bucket) may be in flight at once, adapted to throttling.

    An AIMD window (NOTE [fetch throttling]) shared by every fetch thread of the process:
    ``with limiter.slot(cancel) as started:`` holds one of the window's places for one
    request; ``throttled(started, pause)`` reports a throttled response (cut the window,
    pause the host), ``ok()`` a success (widen the window). ``ceiling`` bounds the window;
    it starts there, so only a throttle ever limits anything.
    """

    def __init__(self, ceiling: int = 64, name: str = "") -> None:
        if ceiling < 1:
            raise ValueError("ceiling must be >= 1")
        self.ceiling = ceiling
        self.name = name  # the host (or bucket) key, for the throttling report
        self.give_up_after: float | None = None  # the latest slot()'s throttle deadline
        self.reports = 0  # throttling reports logged
        self.report_first_s = _THROTTLE_REPORT_FIRST_S
        self.report_every_s = _THROTTLE_REPORT_EVERY_S
        self._reported_at: float | None = None
        self._cv = threading.Condition(threading.Lock())
        self._window = float(ceiling)
        self._in_flight = 0
        self._waiting = 0
        self._pause_until = 0.0
        self._last_cut = float("-inf")
        self._streak = 0  # throttled responses since the last success
        self._streak_since: float | None = None  # when the first of them came
        self._idle_since = time.monotonic()
        self.throttles = 0  # throttled responses, in all
        self.peak = 0  # most requests in flight at once
        self.lowest = ceiling  # the smallest window a throttle cut it to
        self.last_signal = ""  # what the last throttled response said, e.g. "HTTP 503, Retry-After 1 s"

    # -- state (read without the lock: for messages and tests) -------------------------
    @property
    def window(self) -> int:
        """Requests that may be in flight now."""
        return max(1, int(self._window))

    @property
    def in_flight(self) -> int:
        """Requests holding a place now."""
        return self._in_flight

    @property
    def streak(self) -> int:
        """Throttled responses since the host's last success."""
        return self._streak

    def streak_seconds(self) -> float:
        """Seconds since the first throttled response after the host's last success (0 if none)."""
        since = self._streak_since
        return 0.0 if since is None else time.monotonic() - since

    # -- use ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def slot(self, cancel: threading.Event | None = None, *,
             give_up_after: float | None = None) -> Iterator[float]:
        """Holds a place in the window for one request; yields the time it was granted.

        Blocks while the window is full or the host is paused. Raises ``_Cancelled`` when
        ``cancel`` is set meanwhile, ``_ThrottleExpired`` when the host has answered only
        throttles for ``give_up_after`` seconds and nothing is in flight.
        """
        if give_up_after is not None:
            self.give_up_after = give_up_after
        started = self._acquire(cancel, give_up_after)
        try:
            yield started
        finally:
            with self._cv:
                self._in_flight -= 1
                if not self._in_flight and not self._waiting:
                    self._idle_since = time.monotonic()
                self._cv.notify_all()

    def _acquire(self, cancel: threading.Event | None, give_up_after: float | None) -> float:
        with self._cv:
            now = time.monotonic()
            if not self._in_flight and not self._waiting:
                idle = now - max(self._idle_since, self._pause_until)
                if idle > _STREAK_IDLE_S:
                    self._streak, self._streak_since = 0, None
                if idle > _WINDOW_IDLE_S:
                    self._window = float(self.ceiling)
            self._waiting += 1
            try:
                while True:
                    now = time.monotonic()
                    if self._in_flight < self.window and now >= self._pause_until:
                        self._in_flight += 1
                        self.peak = max(self.peak, self._in_flight)
                        return now
                    if cancel is not None and cancel.is_set():
                        raise _Cancelled()
                    if (give_up_after is not None and not self._in_flight and self._streak_since is not None
                            and now - self._streak_since > give_up_after):
                        raise _ThrottleExpired()
                    self._report(now)
                    left = self._pause_until - now
                    self._cv.wait(min(left, CANCEL_POLL_S) if left > 0 else CANCEL_POLL_S)
            finally:
                self._waiting -= 1

    def throttled(self, started: float, pause: float, signal: str = "") -> float:
        """A request granted at ``started`` was throttled: cut the window, pause the host.

        The host is paused ``pause`` seconds; ``signal`` says how the server throttled.
        Returns how long the host has answered only throttles.
        """
        with self._cv:
            now = time.monotonic()
            self.throttles += 1
            self.last_signal = signal or self.last_signal
            self._streak += 1
            if self._streak_since is None:
                self._streak_since = now
            if started >= self._last_cut:
                self._window = max(1.0, min(self._window, float(max(self._in_flight, 1))) / 2)
                self._last_cut = now
                self.lowest = min(self.lowest, self.window)
            self._pause_until = max(self._pause_until, now + pause)
            self._cv.notify_all()
            self._report(now)
            return now - self._streak_since

    def _report(self, now: float) -> None:
        """Logs the throttling streak when due (NOTE [fetch throttling]); the caller holds the lock."""
        since = self._streak_since
        if since is None or now - since < self.report_first_s:
            return
        if self._reported_at is not None and self._reported_at >= since and now - self._reported_at < \
                self.report_every_s:
            return
        self._reported_at = now
        self.reports += 1
        streak_s = now - since
        left = ""
        if self.give_up_after is not None:
            left = (f"; its requests fail once it has throttled for {self.give_up_after:g} s, "
                    f"{max(0.0, self.give_up_after - streak_s):.0f} s from now (PYLOADER_FETCH_THROTTLE_DEADLINE)")
        _log.warning("pyloader: %s is throttling: %d throttled responses in %.0f s since its last success "
                     "(last: %s); request window %d, %d in flight, %d waiting%s", self.name or "the host",
                     self._streak, streak_s, self.last_signal or "throttled", self.window, self._in_flight,
                     self._waiting, left)

    def ok(self) -> None:
        """A request succeeded: the streak is over; a full window widens by ``1/window``."""
        with self._cv:
            self._streak, self._streak_since = 0, None
            if self._waiting or self._in_flight >= self.window:
                before = self.window
                self._window = min(float(self.ceiling), self._window + 1.0 / self._window)
                if self.window > before:
                    self._cv.notify_all()


_LIMITERS: dict[str, HostLimiter] = {}
_LIMITERS_MU = threading.Lock()


def host_key(url: str) -> str:
    """``scheme://host`` of ``url`` (an S3 URL's bucket): what one limiter covers."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "file://"
    return scheme.lower() + "://" + rest.split("/", 1)[0].lower()


def host_limiter(url: str) -> HostLimiter:
    """The process's ``HostLimiter`` for ``url``'s scheme and host (an S3 URL's bucket)."""
    key = host_key(url)
    with _LIMITERS_MU:
        lim = _LIMITERS.get(key)
        if lim is None:
            lim = _LIMITERS[key] = HostLimiter(name=key)
        return lim


def forget_limiters() -> None:
    """Drops every host's limiter (a forked child, and tests that reuse a port)."""
    # A forked child has none of its parent's requests in flight, and a lock a parent
    # thread held at the fork would never be released.
    global _LIMITERS_MU
    _LIMITERS_MU = threading.Lock()
    _LIMITERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=forget_limiters)


__all__ = ["CANCEL_POLL_S", "HostLimiter", "forget_limiters", "host_key",
           "host_limiter"]

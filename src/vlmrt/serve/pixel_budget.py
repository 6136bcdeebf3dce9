"""The server's decoded-pixel budgets (docs/server.md, "Limits"; docs/limits.md, "Decoded pixels").

A compressed image can decode to far more memory than its bytes (a 15 KB PNG of 10900 × 10900 is 119 million pixels),
so the body limit does not bound what a request costs. Every image's header is read first (Image.open decodes no
pixel); the pixels its decode will allocate (a JPEG at the size its draft decodes to: runtime/media/image.py) count
against two budgets before any pixel is decoded:

- per request (--max-request-pixels): a request whose images decode to more is refused, 413 `image_too_large`;
- in flight (--max-pixels-in-flight): the decoded pixels of every request between its decode and its answer (its
  images are held while it waits in the queue and runs). A request that would pass it is refused, 503
  `pixels_in_flight` with Retry-After, as a full queue is: retrying later succeeds once others are answered.

    budget = PixelBudget(per_request=64_000_000, in_flight=256_000_000, spec=manifest.image)
    held = budget.hold()          # one request's reservation, empty
    held.take([w * h, ...])       # APIError 413 / 503, else reserved
    held.release()                # when the request is answered, failed or cancelled (idempotent)
"""

from __future__ import annotations

import threading

from .errors import APIError, unavailable
from .limits import MAX_PIXELS_IN_FLIGHT, MAX_REQUEST_PIXELS


def mp(pixels: int) -> str:
    """Pixels in millions, as messages and options say them."""
    return f"{pixels / 1e6:.1f}".removesuffix(".0")


class PixelBudget:
    def __init__(self, per_request: int = MAX_REQUEST_PIXELS, in_flight: int = MAX_PIXELS_IN_FLIGHT, spec=None):
        """spec: the bundle's image op (manifest.image), which decides how small a large JPEG may be decoded."""
        if not 0 < per_request <= in_flight:
            raise ValueError("--max-request-pixels must be > 0 and at most --max-pixels-in-flight")
        self.per_request, self.in_flight, self.spec = per_request, in_flight, spec
        self.held = 0  # pixels reserved now, all requests
        self.refused = 0  # requests refused for the in-flight budget
        self._lock = threading.Lock()

    def hold(self) -> "Reservation":
        return Reservation(self)


class Reservation:
    """One request's share of the in-flight budget."""

    def __init__(self, budget: PixelBudget):
        self.budget, self.pixels = budget, 0

    def take(self, pixels: list[int], sizes: list[tuple[int, int]] = ()) -> None:
        """Reserve a request's images' decoded pixels (each image's, from its header), or refuse the request."""
        b, total = self.budget, sum(pixels)
        if total > b.per_request:
            big = max(range(len(pixels)), key=pixels.__getitem__)
            size = f"{sizes[big][0]}×{sizes[big][1]}" if sizes else ""
            what = (f"image 1 decodes to {mp(total)} million pixels ({size})" if len(pixels) == 1 else
                    f"the request's {len(pixels)} images decode to {mp(total)} million pixels (the largest, image "
                    f"{big + 1}, {size})")
            raise APIError(413, f"{what}; this server decodes at most {mp(b.per_request)} million per request",
                           "invalid_request_error", "image_too_large")
        with b._lock:
            if b.held + total > b.in_flight:
                b.refused += 1
                busy = b.held
            else:
                b.held += total
                self.pixels += total
                return
        raise unavailable(f"the server is holding {mp(busy)} million decoded pixels of other requests' images; this "
                          f"request's {mp(total)} million would pass its limit of {mp(b.in_flight)} million in flight; "
                          "retry later", "pixels_in_flight")

    def release(self) -> None:
        b = self.budget
        with b._lock:
            b.held -= self.pixels
            self.pixels = 0

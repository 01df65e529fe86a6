"""Small python tools for tests and the README's example (`kind = "python"`, `callable =
"kame.testing.tools:..."`)."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

ORDERS = {"A17": "shipped on Monday, arriving Thursday", "B42": "waiting for the payment"}


def order_status(order_id: str) -> str:
    """The delivery status of a customer's order.

    Args:
        order_id: the order number, such as A17
    """
    return ORDERS.get(order_id.strip().upper(), f"no order {order_id}")


async def convert(amount: float, unit: Literal["km", "mi"] = "km", digits: int | None = None) -> dict:
    """Convert a distance between kilometres and miles.

    Args:
        amount: the distance
        unit: the unit the amount is in
        digits: round to this many digits
    """
    await asyncio.sleep(0)
    value = amount * 0.621371 if unit == "km" else amount / 0.621371
    return {"value": round(value, digits) if digits is not None else value, "unit": "mi" if unit == "km" else "km"}


def explode(reason: str = "scripted") -> str:
    """Always fails."""
    raise RuntimeError(f"the tool broke: {reason}")


def slow(seconds: float = 30.0) -> str:
    """Sleeps (on its worker thread) longer than any timeout."""
    time.sleep(seconds)
    return "too late"


LEG_CALLS: list[str] = []  # every call of `legs`, to count them in tests


def legs(animal: str) -> str:
    """How many legs an animal has.

    Args:
        animal: the animal, such as spider
    """
    LEG_CALLS.append(animal)
    return {"spider": "spiders have eight legs", "ant": "ants have six legs"}.get(animal.lower(), "nobody knows")


PONDERED: list[str] = []  # "started" / "cancelled" / "done" of every `ponder` call


async def ponder(seconds: float = 10.0) -> str:
    """Thinks for a long time (an async tool whose cancellation a test can see)."""
    PONDERED.append("started")
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        PONDERED.append("cancelled")
        raise
    PONDERED.append("done")
    return "after long thought: no idea"

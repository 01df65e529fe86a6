"""The worked example's python tool (README, "Knowledge and tools"): `kind = "python"`,
`callable = "shop_tools:order_status"`. Its JSON schema comes from the type hints and docstring."""

ORDERS = {"A17": "shipped on Monday, arriving Thursday", "B42": "waiting for the payment"}


def order_status(order_id: str) -> str:
    """The delivery status of a customer's order.

    Args:
        order_id: the order number, such as A17
    """
    return ORDERS.get(order_id.strip().upper(), f"there is no order {order_id}")

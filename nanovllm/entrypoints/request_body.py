"""A server request's JSON object body, or the route family's own 400 error."""
import json
from collections.abc import Callable


async def json_object(request, error: Callable[[str], Exception]) -> dict:
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise error(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise error("the request body must be a JSON object")
    return body

"""A rejection answered as the policy's ``rejection:`` says (its status, content type and
rendered body), with the same rate-limit headers and ``Retry-After`` as the default answer."""

from __future__ import annotations

from aiohttp import web
from multidict import CIMultiDict

from gateway.edge.responses import SERVER


def custom_rejection_response(
    status: int,
    content_type: str,
    body: bytes,
    headers: list[tuple[str, str]],
    *,
    close: bool = False,
) -> web.Response:
    response = web.Response(status=status, body=body, headers=CIMultiDict(headers))
    response.headers["Server"] = SERVER
    response.headers["Content-Type"] = content_type
    if close:
        response.force_close()
    return response

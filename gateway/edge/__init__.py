"""The edge: the client listener and request handler, request checks and header rewriting, the
upstream client, the WebSocket relay, and the gateway's own answers."""

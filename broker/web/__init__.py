"""The broker's web service: Pulsar's REST admin API (`/admin/v2`), HTTP
lookup (`/lookup/v2`) and `/metrics`, served by hypercorn on the broker's
trio loop."""

from broker.web.front_end import WebFrontEnd

__all__ = ["WebFrontEnd"]

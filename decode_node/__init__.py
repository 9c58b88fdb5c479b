"""The decode node: takes requests, prefills short ones itself, reserves KV blocks for the rest and has
them prefilled on a prefill node whose KV it receives, and streams the generated tokens.

    service       the gRPC service (RPCs only) and the request table
    request       DecodeRequest: one object per request, its typed stage
    reservations  the reservation queue (blocks before any prefill work)
    remote        the driver of one remote prefill and KV transfer
    responses     the GenerateResponse messages of a request's outputs
    metrics       the decode pool's metrics
    config        DecodeNodeConfig
    client        a command-line client for smoke checks
"""

"""The HTTP edge: the server, the endpoint's checks, client auth and the admin API."""

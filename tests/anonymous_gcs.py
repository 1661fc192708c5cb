"""A GCS JSON API on 127.0.0.1 that answers like Google's to requests without credentials: a public bucket's
objects are read, a private bucket answers 401 (or 403) with Google's error body. Enough of the API for gcsfs
reads (object metadata, media, listings). The process is pointed at it through fsspec's own endpoint setting
(FSSPEC_GCS_ENDPOINT_URL), not STORAGE_EMULATOR_HOST, so that the credentials look-up still runs as on a laptop.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANONYMOUS = ("Anonymous caller does not have storage.objects.get access to the Google Cloud Storage object. "
             "Permission 'storage.objects.get' denied on resource (or it may not exist).")


class AnonymousGcs:
  """`objects`: {"bucket/name": bytes}; `private`: {bucket or "bucket/name": 401 or 403}. `requests` lists (method, path,
  whether an Authorization header came) of every request answered."""

  def __init__(self, objects: dict[str, bytes], private: dict[str, int]):
    self.objects, self.private = objects, private
    self.requests: list[tuple[str, str, bool]] = []
    self.content_range = ""
    server = self

    class Handler(BaseHTTPRequestHandler):
      def log_message(self, *args: object) -> None:
        pass

      def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server.requests.append(("GET", self.path, "Authorization" in self.headers))
        status, body, kind = server.answer(self.path, self.headers.get("Range"))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        if status in (200, 206) and kind == "application/octet-stream":
          self.send_header("x-goog-generation", "1")  # TensorStore reads the generation from it
        if status == 206:
          self.send_header("Content-Range", server.content_range)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    class Server(ThreadingHTTPServer):
      def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client that hung up early (gcsfs cancels the slower of two parallel requests)

    self.httpd = Server(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

  def __enter__(self) -> AnonymousGcs:
    self.thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self.httpd.shutdown()
    self.httpd.server_close()

  def answer(self, raw: str, byte_range: str | None) -> tuple[int, bytes, str]:
    url = urllib.parse.urlsplit(raw)
    query = urllib.parse.parse_qs(url.query)
    parts = url.path.split("/")  # ['', ('download',) 'storage', 'v1', 'b', bucket, ('o', name)]
    if parts[1] == "download":
      parts = parts[1:]
    if parts[1:4] != ["storage", "v1", "b"] or len(parts) < 5:
      return self.error(404, "Not Found")
    bucket = parts[4]
    if not any(key.split("/")[0] == bucket for key in [*self.objects, *self.private]):
      return self.error(404, "The specified bucket does not exist.")
    if bucket in self.private:
      return self.error(self.private[bucket], ANONYMOUS)
    if len(parts) == 5:
      return self.json({"kind": "storage#bucket", "name": bucket})
    if len(parts) == 6 and parts[5] == "o":
      return self.listing(bucket, query.get("prefix", [""])[0], query.get("delimiter", [""])[0])
    name = urllib.parse.unquote("/".join(parts[6:]))
    if f"{bucket}/{name}" in self.private:  # an object kept private in a bucket that answers
      return self.error(self.private[f"{bucket}/{name}"], ANONYMOUS)
    data = self.objects.get(f"{bucket}/{name}")
    if data is None:
      return self.error(404, "No such object: " + f"{bucket}/{name}")
    if query.get("alt") == ["media"]:
      if byte_range:
        start, _, end = byte_range.removeprefix("bytes=").partition("-")
        first, last = int(start or 0), min(int(end), len(data) - 1) if end else len(data) - 1
        self.content_range = f"bytes {first}-{last}/{len(data)}"
        return 206, data[first:last + 1], "application/octet-stream"
      return 200, data, "application/octet-stream"
    return self.json(self.metadata(bucket, name, data))

  def listing(self, bucket: str, prefix: str, delimiter: str) -> tuple[int, bytes, str]:
    items, prefixes = [], set()
    for key, data in sorted(self.objects.items()):
      b, _, name = key.partition("/")
      if b != bucket or not name.startswith(prefix):
        continue
      rest = name[len(prefix):]
      if delimiter and delimiter in rest:
        prefixes.add(prefix + rest.split(delimiter, 1)[0] + delimiter)
      else:
        items.append(self.metadata(bucket, name, data))
    return self.json({"kind": "storage#objects", "items": items, "prefixes": sorted(prefixes)})

  @staticmethod
  def metadata(bucket: str, name: str, data: bytes) -> dict[str, str]:
    return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)), "generation": "1",
            "metageneration": "1", "contentType": "application/octet-stream", "updated": "2026-01-01T00:00:00.000Z",
            "timeCreated": "2026-01-01T00:00:00.000Z", "storageClass": "STANDARD"}

  @staticmethod
  def json(value: object) -> tuple[int, bytes, str]:
    return 200, json.dumps(value).encode(), "application/json"

  @staticmethod
  def error(code: int, message: str) -> tuple[int, bytes, str]:
    body = {"error": {"code": code, "message": message, "errors": [{"message": message, "domain": "global",
                                                                     "reason": "required" if code == 401 else
                                                                     "forbidden"}]}}
    return code, json.dumps(body).encode(), "application/json"

from django.urls import path

from playground.consumers import GenerateConsumer

websocket_urlpatterns = [
    path("ws/generate/", GenerateConsumer.as_asgi()),
]

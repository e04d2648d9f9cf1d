import json
from datetime import timedelta

import duebox_django
from django.db import transaction
from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from orders.jobs import jobs
from orders.models import Order, Stock


class OutOfStock(Exception):
    pass


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    try:
        with transaction.atomic():  # the order, its job and the stock: all or nothing
            order = Order.objects.create(item_id=body["item"], quantity=int(body["quantity"]))
            with duebox_django.connection() as conn:  # Django's connection, its transaction
                job_id = jobs.schedule(conn, "send-confirmation", {"order_id": order.id},
                                       delay=timedelta(seconds=float(body.get("confirm_after", 0))),
                                       key=f"confirm-order:{order.id}")
            taken = Stock.objects.filter(item=order.item_id, available__gte=order.quantity
                                         ).update(available=F("available") - order.quantity)
            if taken != 1:
                raise OutOfStock  # rolls back the order and the job
    except OutOfStock:
        return JsonResponse({"detail": f"not enough {body['item']!r} in stock"}, status=409)
    return JsonResponse({"order_id": order.id, "job_id": str(job_id)}, status=201)


@require_GET
def get_order(request: HttpRequest, order_id: int) -> JsonResponse:
    order = get_object_or_404(Order, id=order_id)
    return JsonResponse({"order_id": order.id, "item": order.item_id,
                         "confirmations": order.confirmations})

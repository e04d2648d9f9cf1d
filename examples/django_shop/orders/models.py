from django.db import models


class Stock(models.Model):
    item = models.CharField(max_length=100, primary_key=True)
    available = models.IntegerField()


class Order(models.Model):
    item = models.ForeignKey(Stock, on_delete=models.PROTECT, db_column="item")
    quantity = models.IntegerField()
    confirmations = models.IntegerField(default=0)

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Stock",
            fields=[
                ("item", models.CharField(max_length=100, primary_key=True, serialize=False)),
                ("available", models.IntegerField()),
            ],
        ),
        migrations.CreateModel(
            name="Order",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True,
                                           serialize=False, verbose_name="ID")),
                ("quantity", models.IntegerField()),
                ("confirmations", models.IntegerField(default=0)),
                ("item", models.ForeignKey(db_column="item",
                                           on_delete=django.db.models.deletion.PROTECT,
                                           to="orders.stock")),
            ],
        ),
    ]

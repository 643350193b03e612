"""Export a topic's closed ledgers as Parquet with spark-submit, through the
same data source as `quire export` (see docs/operations.md, "On a Spark
cluster"). Unlike `quire export`, it keeps no manifest: every run reads
every closed ledger (or those given with the `ledgers` option).

    spark-submit --master spark://HOST:7077 --archives quire-env.tar.gz#quire-env \
        --conf spark.pyspark.python=./quire-env/bin/python \
        spark_submit_export.py ZK ROOT TOPIC OUT
"""

import sys

from pyspark.sql import SparkSession

from broker.spark_source import register

zk, root, topic, out = sys.argv[1:5]
spark = SparkSession.builder.appName(f"export {topic}").getOrCreate()
register(spark)  # spark.read.format("quire") in this session
frame = spark.read.format("quire").option("zk", zk).option("root", root).option("topic", topic).load()
frame.write.mode("errorifexists").parquet(out)
print(f"{spark.read.parquet(out).count()} rows of {topic} written to {out}")
spark.stop()
